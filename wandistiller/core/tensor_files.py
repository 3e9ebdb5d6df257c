"""Cheap facts about weight files, checked before anything heavy happens.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and byte
range, then the data. Reading the header costs one small read and tells a truncated, garbage or empty file from a
good one without loading any weights. A file of a received folder is read through the guard (core/files.py).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from wandistiller.core.files import open_in

# Larger than any real header (a 14B expert's is about 100 KiB); a garbage length is caught before reading it.
MAX_HEADER_BYTES = 100 * 2**20
DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


def file_stamps(folder: Path, pattern: str) -> list[tuple[str, int, int]]:
    """(name, size, mtime in ns) of the files matching `pattern`: part of a cache key, so a teacher whose
    files were rewritten (a new download, a rebuilt tiny teacher) gets new caches. Hashing gigabytes of
    weights would cost minutes; a rewrite changes the mtime."""
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.glob(pattern) if p.is_file())


def safetensors_problem(path: Path, root: Path | None = None) -> str | None:
    """What makes `path` not a whole safetensors file, in words; None if its header and size agree. `root`: the
    received folder it lies in, read through the guard (`open_in`); a link out of it is refused in one line."""
    return safetensors_header(path, root=root)[1]


def safetensors_header(
    path: Path, dtypes: dict[str, int] | None = None, root: Path | None = None
) -> tuple[dict, str | None]:
    """(the tensors' header entries, None) for a whole safetensors file; ({}, what is wrong) otherwise.

    Every check the format's own loader makes, so that a hostile header is one line here and never an error
    deep inside safetensors or diffusers: a JSON object without duplicate names; `__metadata__` an object of
    strings; each entry a known dtype, a shape of non-negative integers and two ordered offsets;
    each byte range the size its dtype and shape need; the ranges back to back from 0, neither overlapping
    nor leaving gaps, ending exactly at the file's end. `dtypes`: the dtypes allowed (name -> bytes). `root`: the
    received folder `path` lies in (through the guard: `open_in`); None for the user's own files (a teacher)."""
    dtypes = DTYPE_BYTES if dtypes is None else dtypes
    try:
        with open_in(root, path) if root is not None else path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size  # of what was opened, not of what the name says now
            head = f.read(8)
            if len(head) < 8:
                return {}, f"{path} is {size} bytes, too short to be a safetensors file (truncated or empty)"
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                return {}, f"{path} is not a safetensors file, or is truncated (its header claims {n} bytes)"
            header = json.loads(f.read(n), object_pairs_hook=_no_duplicates)
    except OSError as e:
        return {}, f"{path} cannot be read ({e.strerror})"
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}, f"{path} is not a safetensors file (its header is not JSON)"
    except (ValueError, RecursionError) as e:  # a duplicate name, a header nested too deep
        return {}, f"{path} is not a safetensors file ({e if isinstance(e, ValueError) else 'nested too deeply'})"
    if not isinstance(header, dict):
        return {}, f"{path} is not a safetensors file (its header is not a JSON object)"
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        return {}, f"{path} is damaged: its __metadata__ must map names to strings"
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    spans = []
    for name, info in entries.items():
        bad = _entry_problem(info, dtypes)
        if bad == "fields":
            return {}, f"{path} is not a safetensors file (tensor {name!r} has no dtype/shape/data_offsets)"
        if bad:
            return {}, f"{path} is damaged: tensor {name!r} {bad}"
        (start, stop), want = info["data_offsets"], math.prod(info["shape"]) * dtypes[info["dtype"]]
        if stop - start != want:
            return {}, f"{path} is damaged: tensor {name!r} spans {stop - start} bytes, its shape needs {want}"
        spans.append((start, stop, name))
    end = 0
    for start, stop, name in sorted(spans):
        if start != end:
            what = "overlaps the one before it" if start < end else f"leaves a gap of {start - end} bytes before it"
            return {}, f"{path} is damaged: tensor {name!r} {what} (its data starts at byte {start}, not {end})"
        end = stop
    if 8 + n + end != size:
        return {}, f"{path} is {size} bytes but its header describes {8 + n + end}: truncated or damaged"
    return entries, None


def _entry_problem(info, dtypes: dict[str, int]) -> str | None:
    """What is wrong with one tensor's header entry, in words ("fields" when it lacks them); None if right."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        return "fields"
    if not isinstance(info["dtype"], str) or info["dtype"] not in dtypes:
        return f"has dtype {info['dtype']!r}, which is not one of {', '.join(sorted(dtypes))}"
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or len(shape) > 64 or not all(_count(d) for d in shape):
        return f"has shape {str(shape)[:80]}, not a list of sizes"
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        return f"has data_offsets {str(offsets)[:80]}, not [start, end]"
    return None


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63


def _no_duplicates(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"its header names {next(k for k in keys if keys.count(k) > 1)!r} twice")
    return dict(pairs)
