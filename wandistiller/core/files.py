"""Cheap facts about files and folders a run will use, checked before anything heavy happens.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the data. Reading the header costs one small read and tells a truncated,
garbage or empty file from a good one without loading any weights.

A run folder's own files (`in_run`, `write_in_run`, `appendable`, `replace_folder`): a folder someone sent you is
read and written only inside it, never through a link that leads out of it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path

from wandistiller.core.errors import UserError

# The package's shipped assets (prompts, built-in files); one constant so no module imports another for a path.
ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_PROMPTS = ASSETS / "prompts.txt"

# Larger than any real header (a 14B expert's is about 100 KiB); a garbage length is caught before reading it.
MAX_HEADER_BYTES = 100 * 2**20
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}  # fmt: skip


def file_stamps(folder: Path, pattern: str) -> list[tuple[str, int, int]]:
    """(name, size, mtime in ns) of the files matching `pattern`: part of a cache key, so a teacher whose
    files were rewritten (a new download, a rebuilt tiny teacher) gets new caches. Hashing gigabytes of
    weights would cost minutes; a rewrite changes the mtime."""
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.glob(pattern) if p.is_file())


def safetensors_problem(path: Path) -> str | None:
    """What makes `path` not a whole safetensors file, in words; None if its header and size agree."""
    return safetensors_header(path)[1]


def safetensors_header(path: Path, dtypes: dict[str, int] | None = None) -> tuple[dict, str | None]:
    """(the tensors' header entries, None) for a whole safetensors file; ({}, what is wrong) otherwise.

    Every check the format's own loader makes, so that a hostile header is one line here and never an error
    deep inside safetensors or diffusers: a JSON object without duplicate names; `__metadata__` an object of
    strings; each entry a known dtype, a shape of non-negative integers and two ordered offsets;
    each byte range the size its dtype and shape need; the ranges back to back from 0, neither overlapping
    nor leaving gaps, ending exactly at the file's end. `dtypes`: the dtypes allowed (name -> bytes)."""
    dtypes = DTYPE_BYTES if dtypes is None else dtypes
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
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
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets) \
            or offsets[0] > offsets[1]:  # fmt: skip
        return f"has data_offsets {str(offsets)[:80]}, not [start, end]"
    return None


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63


def _no_duplicates(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"its header names {next(k for k in keys if keys.count(k) > 1)!r} twice")
    return dict(pairs)


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
                f.write(data.encode() if isinstance(data, str) else data or b"")
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


# -- a run folder's own files ---------------------------------------------------------------------------------
# A run folder may come from someone else, and any name in it may be a symbolic link (or a hard link) to a file of
# yours: `eval.json -> ~/.bashrc`, `checkpoints -> ../other_run/checkpoints`. Every file a CLI reads from or writes
# into a run folder goes through these: a name is refused, in one line, when following its links leaves the folder;
# a file written whole replaces a link (never writes through it); a file appended to must be the folder's own.


class OutsideRunFolder(UserError):
    """A name in a run folder leads out of it (a symbolic link, or a hard link to another file)."""


def in_run(root: Path, name: str | Path) -> Path:
    """`root / name`, refused (OutsideRunFolder) when following links on the way -- `name`'s own included, and
    where it does not exist yet, as far as it does -- leads out of the run folder `root`. A link inside the
    folder (`latest -> step_00000050`) is fine."""
    root, path = Path(root), _joined(root, name)
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        link = next((p for p in [path, *path.parents] if p.is_symlink()), None)
        how = f"{link} is a symbolic link to {os.readlink(link)}" if link else f"it is {real}"
        raise OutsideRunFolder(
            f"{path} leads out of the run folder ({how}); "
            f"WanDistiller reads and writes a run folder's files only inside it: remove the link, or copy what it "
            "points to into the folder"
        )
    return path


# What a run appends to or adds into besides checkpoints/ (files written whole replace a link instead): a received
# folder's link (or hard link) in one of their places is refused before any work (a resume's claim, eval's start).
APPENDED = (".hydra", "train.log", "metrics_steps.jsonl", "metrics.csv", "tensorboard", "wandb", ".failures",
            "checkpoints")  # fmt: skip


def check_appended(root: Path) -> None:
    """Refuse (one line) a run folder whose APPENDED names lead out of it: before the work, not after."""
    for name in APPENDED:
        appendable(root, name)


def _joined(root: Path, name: str | Path) -> Path:
    """`root / name`, or `name` itself when it is already a path into `root` (a caller's `run.path / "student"`,
    with `root` relative: `outputs/run` joined again would be `outputs/run/outputs/run/student`)."""
    root, name = Path(root), Path(name)
    if name.is_absolute() or (root.parts and name.parts[: len(root.parts)] == root.parts):
        return name
    return root / name


def run_folder(root: Path, name: str | Path) -> Path:
    """The folder `root / name`, made if needed, when it lies inside the run folder (see `in_run`)."""
    path = in_run(root, name)
    path.mkdir(parents=True, exist_ok=True)
    return in_run(root, name)  # a link made meanwhile is caught too


def appendable(root: Path, name: str | Path) -> Path:
    """`root / name` for appending (metrics_steps.jsonl, a log, a csv): inside the run folder, and, if it exists, a
    file of its own: a hard link would append to the other name's file as well."""
    path = in_run(root, name)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return path
    if st.st_nlink > 1 and not os.path.isdir(path):
        raise OutsideRunFolder(
            f"{path} is a hard link ({st.st_nlink} names for one file), so appending to it would write into the "
            "other names' file as well; copy it (cp --remove-destination) or remove it"
        )
    return path


def write_in_run(root: Path, name: str | Path, data: str | bytes | None = None, *, write=None,
                 fsync: bool = True) -> Path:  # fmt: skip
    """`root / name` written whole (`atomic_write`) into the run folder: its folder must lie inside it, and a link
    (symbolic or hard) in the file's place is replaced, never written through."""
    path = _joined(root, name)
    in_run(root, path.parent)
    return atomic_write(path, data, write=write, fsync=fsync)


def replace_folder(root: Path, name: str, write) -> Path:
    """The folder `root / name` written whole: `write(tmp)` fills a fresh folder beside it, which then takes its
    place. What was there (a folder, or a link: never followed) goes, so a received run's `student -> elsewhere`
    or a hard-linked weights file is replaced, not written through. A kill midway leaves `.tmp-<name>-…` or
    `.old-<name>-…`, which `clean_run_leftovers` removes."""
    import shutil

    from wandistiller.core import leftovers

    root = Path(root)
    tmp, old = (root / leftovers.owned_name(f".{what}-{name}") for what in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = root / name
    if final.is_symlink() or final.is_file():
        final.unlink()
    elif final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


TEMPORARY = r"\.(?:tmp|old)-(?:student|student_ema|pipeline)"  # replace_folder's names, before `-<host>-<pid>`


def clean_run_leftovers(root: Path) -> None:
    """Remove the temporary folders of `replace_folder` that a killed process left in the run folder."""
    from wandistiller.core import leftovers

    leftovers.remove_dead(Path(root), TEMPORARY)
