"""A nested training state as data that cannot run code: tensors in safetensors, the rest in JSON.

`torch.load` unpickles, and a crafted pickle runs whatever it names. Here a state (dicts, lists,
tuples, numbers, strings, tensors, numpy arrays -- what optimizers, schedulers, scalers, EMA and RNGs
hand out) is split in two: every tensor goes to a safetensors file and is replaced by a reference;
what is left is JSON, with tuples, non-string keys and numpy arrays spelled out so that they come
back as they went in. Both formats are parsed, never executed.

The safetensors file is written here, with `os.write`, rather than by `safetensors.torch.save_file`:
that keeps one tensor's bytes in memory at a time, lets the writer fsync, and turns a full disk into
an ordinary OSError with its errno.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from wandistiller.core.files import opened
from wandistiller.core.tensor_files import DTYPE_BYTES as _BYTES
from wandistiller.core.tensor_files import safetensors_header

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
NUMPY_DTYPES = {"uint32", "uint64", "int64", "int32", "float64", "float32"}  # what RNG states hold


def encode(obj, tensors: dict[str, torch.Tensor], path: str = "state"):
    """`obj` as JSON-able data; its tensors are moved into `tensors` under unique keys."""
    if isinstance(obj, torch.Tensor):
        key = path if path not in tensors else f"{path}#{len(tensors)}"
        tensors[key] = obj
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v, tensors, f"{path}.{k}") for k, v in obj.items()}
        return {"__items__": [[encode(k, tensors), encode(v, tensors, f"{path}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"a checkpoint cannot hold {type(obj).__name__} (at {path}); only data and tensors")


def decode(data, tensors: Mapping[str, torch.Tensor | None]):
    """The inverse of `encode`. Raises ValueError on anything `encode` would not have written. `tensors` may map
    the tensor file's names to None: the references checked, nothing loaded (state/checkpoint.py's `problem`)."""
    if isinstance(data, list):
        return [decode(v, tensors) for v in data]
    if not isinstance(data, dict):
        return data
    if "__tensor__" in data:
        if data["__tensor__"] not in tensors:
            raise ValueError(f"refers to tensor {data['__tensor__']!r}, which the tensor file lacks")
        return tensors[data["__tensor__"]]
    if "__tuple__" in data:
        return tuple(decode(v, tensors) for v in data["__tuple__"])
    if "__items__" in data:
        return {decode(k, tensors): decode(v, tensors) for k, v in data["__items__"]}
    if "__ndarray__" in data:
        if data.get("dtype") not in NUMPY_DTYPES:
            raise ValueError(f"holds an array of unexpected dtype {data.get('dtype')!r}")
        return np.array(data["__ndarray__"], dtype=data["dtype"])
    return {k: decode(v, tensors) for k, v in data.items()}


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file (the format's spec: 8-byte header length, JSON header, raw bytes), fsynced, whole."""
    header, offset = {}, 0
    for key, t in tensors.items():
        if t.dtype not in DTYPES:
            raise TypeError(f"a checkpoint cannot hold a {t.dtype} tensor ({key})")
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the spec's alignment for the data that follows
    # Into a new file beside it, then renamed over it: a link in its place (a received folder's) is replaced,
    # never written through, and a failed write leaves what was there.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    Path(tmp).unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        try:
            _write_all(fd, struct.pack("<Q", len(raw)) + raw)
            for t in tensors.values():
                flat = t.detach().to("cpu").contiguous().reshape(-1)
                # numpy's stubs: a memoryview of an array is a buffer from 3.12 on
                _write_all(fd, memoryview(flat.view(torch.uint8).numpy()))  # type: ignore[arg-type]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view[: 1 << 30])
        view = view[written:]


def check_tensors(path: Path, root: Path | None = None) -> set[str]:
    """The tensor names of a whole safetensors file of ours; else ValueError. The header must pass every check
    of `tensor_files.safetensors_header` (known dtypes, sizes, back-to-back ranges covering the file exactly), so a
    truncated, padded, garbage or hostile file is caught from its first bytes, before safetensors reads it. `root`:
    the folder it lies in (default its own): read through the guard (core.files.open_in)."""
    entries, problem = safetensors_header(path, {name: _BYTES[name] for name in DTYPES.values()}, root or path.parent)
    if problem:
        raise ValueError(problem.replace(str(path), path.name))
    return set(entries)


def read_tensors(path: Path, root: Path | None = None) -> dict[str, torch.Tensor]:
    """The tensors of `path`, opened through the guard inside `root` (default its own folder): safetensors reads
    the descriptor the guard opened (core.files.opened), so a link swapped in meanwhile is never followed."""

    with opened(root or path.parent, path) as guarded:
        return load_file(guarded, device="cpu")
