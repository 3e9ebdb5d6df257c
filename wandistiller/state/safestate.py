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
MAX_HEADER = 100 * 2**20  # a header larger than this is not one we wrote


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
    """A safetensors file (the format's spec: 8-byte header length, JSON header, raw bytes), fsynced."""
    header, offset = {}, 0
    for key, t in tensors.items():
        if t.dtype not in DTYPES:
            raise TypeError(f"a checkpoint cannot hold a {t.dtype} tensor ({key})")
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the spec's alignment for the data that follows
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            flat = t.detach().to("cpu").contiguous().reshape(-1)
            _write_all(fd, memoryview(flat.view(torch.uint8).numpy()))  # type: ignore[arg-type]  # numpy's stubs: a buffer from 3.12 on
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view[: 1 << 30])
        view = view[written:]


def check_tensors(path: Path) -> set[str]:
    """The tensor names of a whole safetensors file; else ValueError. A sane header must cover the file
    exactly, so a truncated, padded or garbage file is caught from its first bytes."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path.name} is {size} bytes, too short to be a tensor file")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):
            raise ValueError(f"{path.name} is not a safetensors file (or is truncated)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(f"{path.name} has an unreadable header") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name} has an unreadable header")
    entries = {k: e for k, e in header.items() if k != "__metadata__"}
    if not all(isinstance(e, dict) and e.get("dtype") in DTYPES.values() for e in entries.values()):
        raise ValueError(f"{path.name} describes a tensor it cannot hold")
    end = max((e["data_offsets"][1] for e in entries.values()), default=0)
    if 8 + n + end != size:
        raise ValueError(f"{path.name} is {size} bytes but its header describes {8 + n + end}")
    return set(entries)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path, device="cpu")
