"""Cheap facts about files and folders a run will use, checked before anything heavy happens.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the data. Reading the header costs one small read and tells a truncated,
garbage or empty file from a good one without loading any weights.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path

# The package's shipped assets (prompts, built-in files); one constant so no module imports another for a path.
ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_PROMPTS = ASSETS / "prompts.txt"

# Larger than any real header (a 14B expert's is about 100 KiB); a garbage length is caught before reading it.
MAX_HEADER_BYTES = 100 * 2**20
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}  # fmt: skip


def file_stamps(folder: Path, pattern: str) -> list[tuple[str, int, int]]:
    """(name, size, mtime in ns) of the files matching `pattern`: part of a cache key, so a teacher whose
    files were rewritten (a new download, a rebuilt tiny teacher) gets new caches. Hashing gigabytes of
    weights would cost minutes; a rewrite changes the mtime."""
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.glob(pattern) if p.is_file())


def safetensors_problem(path: Path) -> str | None:
    """What makes `path` not a whole safetensors file, in words; None if its header and size agree."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path} is {size} bytes, too short to be a safetensors file (truncated or empty)"
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                return f"{path} is not a safetensors file, or is truncated (its header claims {n} bytes)"
            header = json.loads(f.read(n))
    except OSError as e:
        return f"{path} cannot be read ({e.strerror})"
    except (UnicodeDecodeError, json.JSONDecodeError):
        return f"{path} is not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return f"{path} is not a safetensors file (its header is not a JSON object)"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = info["data_offsets"]
            want = math.prod(info["shape"]) * _DTYPE_BYTES.get(info["dtype"], 0)
        except (TypeError, KeyError, ValueError):
            return f"{path} is not a safetensors file (tensor {name!r} has no dtype/shape/data_offsets)"
        if _DTYPE_BYTES.get(info["dtype"]) and stop - start != want:
            return f"{path} is damaged: tensor {name!r} spans {stop - start} bytes, its shape needs {want}"
        end = max(end, stop)
    if 8 + n + end != size:
        return f"{path} is {size} bytes but its header describes {8 + n + end}: truncated or damaged"
    return None


def folder_problem(folder: Path) -> str | None:
    """Why `folder` could not be created and written to, in words; None if it can (it need not exist yet).

    Walks up to the nearest existing ancestor: a file there means the path runs through a file, and
    only that ancestor's permissions (and its file system's read-only flag) decide whether the rest can
    be created. os.access sees a read-only mount even for root.
    """
    path = Path(folder).expanduser().absolute()
    probe = path
    while not probe.exists():
        if probe.is_symlink():  # a dangling link: mkdir would fail on it
            return f"{probe} is a broken symbolic link"
        probe = probe.parent
    if not probe.is_dir():
        return f"{path} runs through {probe}, which is a file" if probe != path else f"{path} is a file"
    if not os.access(probe, os.W_OK | os.X_OK):
        why = "a read-only file system" if _read_only(probe) else "no write permission"
        return f"{probe} cannot be written ({why})"
    return None


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


@contextlib.contextmanager
def held_exclusively(lock_file: Path) -> Iterator[None]:
    """One process at a time in the block, across processes sharing a folder (two runs, a sweep's points, the
    ranks of a run): an exclusive flock on `lock_file`, released when the block ends or the process dies.
    The file stays: removing it while another process waits on it would let a third take a new one."""
    import fcntl

    lock_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def atomic_write(path: Path, data: str | bytes | None = None, *, write=None, fsync: bool = True) -> Path:
    """`path` written whole or not at all: into a temporary sibling, flushed, then renamed over it, so a reader
    (or a run killed mid-write, or a full disk) never leaves half a file. Give the text or bytes, or
    `write(file)` that writes into the open binary file (torch.save, a figure's savefig)."""
    import tempfile

    path = Path(path)
    f = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False)
    try:
        with f:
            if write is not None:
                write(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        # NamedTemporaryFile makes the file owner-only (0600); give it what open() would have (0666 & ~umask).
        os.chmod(f.name, 0o666 & ~_umask())
        os.replace(f.name, path)
    except BaseException:
        Path(f.name).unlink(missing_ok=True)
        raise
    return path


def save_tensors(obj, path: Path) -> Path:
    """`torch.save(obj)` at `path` (its folder made), whole or not at all (`atomic_write`): a reader never sees half
    a cache file, and a failed write (a full disk) leaves no partial file and is one line naming the file."""
    import torch

    from wandistiller.core.errors import UserError

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return atomic_write(path, write=lambda f: torch.save(obj, f))
    except (OSError, RuntimeError) as e:  # torch.save reports ENOSPC as a RuntimeError from its zip writer
        raise UserError(
            f"the cache file {path} cannot be written ({getattr(e, 'strerror', None) or str(e).splitlines()[0]}); "
            "free some space, or set paths.cache_dir=… to another disk"
        ) from None


def _umask() -> int:
    """The process umask. os.umask can only be read by setting it, so it is set back at once; Linux's
    /proc/self/status shows it without touching it, read first (threads may write files meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
