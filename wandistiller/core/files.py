"""Folders a run will write, checked before anything heavy happens (`folder_problem`, `output_problem`), and the
guarded way in and out of a folder someone may have sent you. Weight files' headers are core/tensor_files.py's, files
written whole core/atomic.py's, the shipped assets' place core/assets.py's.

A run folder's own files (`in_run`, `write_in_run`, `appendable`, `replace_folder`): a folder someone sent you is
read and written only inside it, never through a link that leads out of it.

The guarded opener (one way in and out of a folder someone may have sent you: a run folder, a `student.init`
folder, an export's `--out`): every file is opened through these, at any depth --

    open_in(root, name, "rb" | "r" | "ab" | "a")   a file object; "w"/"wb" are `write_in_run` (written whole)
    read_in(root, name, limit) / read_json_in(...)  bytes or parsed JSON, their size bounded
    write_in_run(root, name, data | write=...)      written whole, a link in its place replaced, never written through
    opened(root, name)                              a context manager: `/proc/self/fd/N` of the opened file, for a
                                                    library that takes a path (safetensors' `safe_open`/`load_file`)
    check_tree(root, folder)                        every file under `folder` checked: before `from_pretrained`

What is opened is checked, not only its name: the name's links are resolved and must stay inside `root` (a link
inside may stay: `latest -> step_00000050`), then the resolved path is opened from `root`'s descriptor one component
at a time with O_NOFOLLOW, so a component swapped for a link between the check and the open is refused (ELOOP), never
followed. Reads also refuse what is not a regular file (a FIFO would block the reader, /dev/zero never ends).

Hard links: a second name of one file is that file, not a way to another one; a stranger's folder cannot carry a hard
link to a file of yours (an archive's hard links stay inside it; Linux's protected_hardlinks forbids linking a file
one cannot write). So a hard-linked file is read as the folder's own, and never written in place: a file written
whole is a new file renamed over the name (the other names keep their content), a file appended to (a log) must
have one name (`appendable`), and an export (`--out`) writes copies, never links (state/export.py's `place`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from wandistiller.core import leftovers
from wandistiller.core.atomic import write_whole_at
from wandistiller.core.errors import UserError


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


def output_problem(folder: Path, name: str | Path | None = None) -> str | None:
    """Why files cannot be written into `folder` (or its `name`, a folder inside it) -- tried, not guessed: a file is
    made in the nearest existing folder and removed, which catches what permission bits do not (a read-only or full
    mount, an immutable folder, /proc, a user without write access to root's folder); None if they can. With
    `name`, a link leading out of `folder` is refused (OutsideRunFolder). Every CLI checks its output so, before
    any work: a report written after 35 minutes must not fail then."""
    target = in_run(folder, name) if name is not None else Path(folder)
    problem = folder_problem(target)
    if problem:
        return problem
    probe = Path(target).expanduser().absolute()
    while not probe.exists():
        probe = probe.parent

    trial = probe / leftovers.owned_name(f".write-check.{os.urandom(4).hex()}")
    try:
        os.close(os.open(trial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        os.unlink(trial)
    except OSError as e:
        return f"{probe} cannot be written ({e.strerror})"
    return None


def overlap(out: Path, place: Path) -> str | None:
    """How `out` meets `place`, links followed: "is", "holds" (place lies inside out), "is inside", or None where
    neither lies in the other. The one test behind every `--out` that must keep off what a command reads."""
    real_out, real = Path(os.path.realpath(out)), Path(os.path.realpath(place))
    if real_out == real:
        return "is"
    if real_out in real.parents:
        return "holds"
    return "is inside" if real in real_out.parents else None


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


# -- a run folder's own files ---------------------------------------------------------------------------------
# A run folder may come from someone else, and any name in it may be a symbolic link (or a hard link) to a file of
# yours: `eval.json -> ~/.bashrc`, `checkpoints -> ../other_run/checkpoints`. Every file a CLI reads from or writes
# into a run folder goes through these: a name is refused, in one line, when following its links leaves the folder;
# a file written whole replaces a link (never writes through it); a file appended to must be the folder's own.


# What an `--out` folder was once given as a file's name (`--out fox.png`, `--out student.safetensors`): a folder of
# that name was made. Pictures, clips and model files; an existing folder of such a name is still taken.
FILE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".mp4", ".webm", ".mov", ".avi",
                 ".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".bin", ".gguf", ".json")  # fmt: skip


def out_folder_problem(out: Path, what: str) -> str | None:
    """Why `--out` names a file where a folder is written (`what`: what goes in it), in words; None where it does
    not."""
    if out.suffix.lower() not in FILE_SUFFIXES or out.is_dir():
        return None
    return f"--out {out} names a file, but --out is a folder ({what}); give a folder (e.g. --out {out.with_suffix('')})"


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
APPENDED = (
    ".hydra",
    "train.log",
    "metrics_steps.jsonl",
    "metrics.csv",
    "tensorboard",
    "wandb",
    ".failures",
    "checkpoints",
)


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


def enclosing_run(path: Path) -> Path | None:
    """The run folder (one holding `.hydra/config.yaml`) that `path` lies inside, `path` itself not counted; None
    where it lies in none."""
    normal = Path(os.path.abspath(Path(path).expanduser()))  # `run/../x` lies beside the run, not in it
    return next((p for p in normal.parents if (p / ".hydra" / "config.yaml").is_file()), None)


def run_holding(path: Path) -> Path | None:
    """The run folder `path` is, or lies inside; None where it is neither (what may not be written into: a cache, a
    sweep's, a benchmark's or a build's folder)."""
    return held_run(Path(path).expanduser(), depth=0) or enclosing_run(path)


def held_run(folder: Path, depth: int = 3) -> Path | None:
    """A run folder (one with `.hydra/config.yaml`) at `folder` or up to `depth` folders below it (a run's
    `outputs/<date>/<time>`), without following links; None if there is none."""
    if (folder / ".hydra" / "config.yaml").is_file():
        return folder
    if depth == 0:
        return None
    try:
        children = [c for c in folder.iterdir() if c.is_dir() and not c.is_symlink()]
    except OSError:
        return None
    return next((found for c in children if (found := held_run(c, depth - 1)) is not None), None)


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


def write_in_run(
    root: Path, name: str | Path, data: str | bytes | None = None, *, write=None, fsync: bool = True
) -> Path:
    """`root / name` written whole (`atomic_write`) into the run folder: its folder must lie inside it (opened from
    `root` with no link followed: see `open_in`), and a link (symbolic or hard) in the file's place is replaced,
    never written through."""
    path = _joined(root, name)
    in_run(root, path.parent)
    dfd = _open_dir(root, path.parent)
    try:
        write_whole_at(dfd, path.name, data, write, fsync)
    finally:
        os.close(dfd)
    return path


# -- the guarded opener ----------------------------------------------------------------------------------------
def _resolved_parts(root: Path, path: Path) -> tuple[str, tuple[str, ...]]:
    """(root's real path, the components of `path`'s real path below it): `path`'s links resolved, each inside."""
    in_run(root, path)
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    return real_root, Path(os.path.relpath(real, real_root)).parts if real != real_root else ()


def _walk(real_root: str, parts: tuple[str, ...], shown: Path) -> int:
    """A descriptor of the folder `real_root/parts...`, opened one component at a time from `real_root` with no link
    followed: a component that became a link since it was checked is refused, never followed."""
    dfd = os.open(real_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            os.close(dfd)
            dfd = nxt
    except OSError as e:
        try:
            _swapped(e, shown, dfd, part)
        finally:
            os.close(dfd)
        raise
    return dfd


def _swapped(error: OSError, shown: Path, dfd: int, part: str) -> None:
    """A link met where the check saw none (O_NOFOLLOW's ELOOP; ENOTDIR for a folder now a link to a file): one
    line. Any other error (a file where a folder should be, a name gone) is the caller's to word."""

    try:
        link = error.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK) and bool(os.readlink(part, dir_fd=dfd))
    except OSError:  # not a link: a file in a folder's place, say
        link = False
    if link:
        raise OutsideRunFolder(
            f"{shown} was replaced by a link while it was being opened; WanDistiller opens a received folder's files "
            "only inside it: make sure nothing else is changing the folder, and run it again"
        ) from None


def _open_dir(root: Path, folder: Path) -> int:
    """A descriptor of `folder` (inside `root`), reached with no link followed after the check."""
    real_root, parts = _resolved_parts(root, _joined(root, folder))
    return _walk(real_root, parts, _joined(root, folder))


def open_fd(root: Path, name: str | Path, flags: int = os.O_RDONLY, mode: int = 0o666) -> int:
    """A raw descriptor of `root / name` opened with `flags` (see `open_in`): the guard's one way in."""

    path = _joined(root, name)
    real_root, parts = _resolved_parts(root, path)
    if not parts:
        raise IsADirectoryError(21, "is the folder itself", str(path))
    dfd = _walk(real_root, parts[:-1], path)
    reading = flags & (os.O_WRONLY | os.O_RDWR) == 0
    try:  # O_NONBLOCK: opening a FIFO to read would block until a writer came
        fd = os.open(
            parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if reading else 0), mode, dir_fd=dfd
        )
    except OSError as e:
        _swapped(e, path, dfd, parts[-1])
        raise
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UserError(f"{path} is not a regular file; WanDistiller reads and writes only plain files in a run folder")
    if reading:
        os.set_blocking(fd, True)
    if flags & os.O_APPEND and st.st_nlink > 1:
        os.close(fd)
        appendable(root, path)  # says it in one line
    return fd


_MODES = {
    "rb": os.O_RDONLY,
    "r": os.O_RDONLY,
    "ab": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
    "a": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
    "a+b": os.O_RDWR | os.O_APPEND | os.O_CREAT,
    "r+": os.O_RDWR,
    "r+b": os.O_RDWR,
}


def open_in(root: Path, name: str | Path, mode: str = "rb", **text):
    """`root / name` opened as `open(path, mode)` would, through the guard: refused in one line (OutsideRunFolder)
    where its links lead out of `root`, or where a component is swapped for a link as it is opened; reads refuse
    what is not a regular file, appends a hard link. Writing a file whole is `write_in_run` (never in place).
    `text`: open()'s encoding/newline/errors for a text mode."""
    if mode not in _MODES:
        raise ValueError(f"open_in: mode {mode!r} is not one of {', '.join(_MODES)} (write whole: write_in_run)")
    if mode.startswith(("a", "r+")):
        appendable(root, name)  # a hard link: one line before anything is opened
    fd = open_fd(root, name, _MODES[mode], 0o666)
    return os.fdopen(fd, mode, **text)


def read_in(root: Path, name: str | Path, limit: int | None = None, what: str = "file") -> bytes:
    """The bytes of `root / name` (through `open_in`), refused in one line where larger than `limit`: read at most
    `limit + 1` bytes, so a file growing as it is read cannot pin the reader."""
    path = _joined(root, name)
    try:
        with open_in(root, path) as f:
            size = os.fstat(f.fileno()).st_size
            if limit is not None and size > limit:
                raise UserError(
                    f"{path} is {size:,} bytes, more than a {what} can be ({limit:,}); it is not one "
                    "WanDistiller wrote: restore it from the run's backup"
                )
            raw = f.read() if limit is None else f.read(limit + 1)
    except OSError as e:
        raise UserError(f"{path} cannot be read ({e.strerror})") from None
    if limit is not None and len(raw) > limit:
        raise UserError(f"{path} grew past {limit:,} bytes while being read; it is not a {what}")
    return raw


def read_text_in(
    root: Path, name: str | Path, limit: int | None = None, what: str = "file", encoding: str = "utf-8"
) -> str:
    """The text of `root / name` (`read_in`); bytes that are not `encoding` are one line."""
    raw = read_in(root, name, limit, what)
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as e:
        raise UserError(
            f"{_joined(root, name)} is not UTF-8 text (byte {e.start}); it is not a {what} WanDistiller wrote"
        ) from None


MAX_JSON_BYTES = 64 * 2**20  # state.json, metrics.json, a model's config.json: KBs to a few MB


def read_json_in(root: Path, name: str | Path, limit: int = MAX_JSON_BYTES, what: str = "JSON file"):
    """`root / name` parsed as JSON (`read_text_in`, its size bounded): UserError for a file that is not its own,
    too large or nested too deep; ValueError for text that is not JSON (the caller says what the file is for)."""
    text = read_text_in(root, name, limit, what, "utf-8-sig")
    try:
        return json.loads(text)
    except RecursionError:
        raise UserError(f"{_joined(root, name)} is nested too deeply to be a {what}") from None


@contextlib.contextmanager
def opened(root: Path, name: str | Path) -> Iterator[str]:
    """For a library that opens a path itself (safetensors' `safe_open`, `load_file`): the guarded file's own
    descriptor as a path (`/proc/self/fd/N`), so what the library opens is what the guard opened, whatever happens
    to the name meanwhile. Where /proc is missing, the checked path itself."""
    fd = open_fd(root, name)
    try:
        yield f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(_joined(root, name))
    finally:
        os.close(fd)


def check_tree(root: Path, folder: str | Path | None = None) -> Path:
    """`folder` (default `root`) before a library reads the whole of it (diffusers' `from_pretrained`): every name
    under it, at any depth, refused in one line (OutsideRunFolder) where a link leads out of `root`; a link to a
    folder inside is walked too. Returns the folder's path."""
    start = _joined(root, folder) if folder is not None else Path(root)
    in_run(root, start)
    seen: set[str] = set()
    todo = [start]
    while todo:
        here = todo.pop()
        real = os.path.realpath(here)
        if real in seen:
            continue
        seen.add(real)
        try:
            entries = list(os.scandir(here))
        except (NotADirectoryError, FileNotFoundError):  # not a folder, or none: the reader that follows says so
            continue
        for entry in entries:
            if entry.is_symlink():
                in_run(root, entry.path)
            if entry.is_dir(follow_symlinks=True):
                todo.append(Path(entry.path))
    return start


def replace_folder(root: Path, name: str, write) -> Path:
    """The folder `root / name` written whole: `write(tmp)` fills a fresh folder beside it, which then takes its
    place. What was there (a folder, or a link: never followed) goes, so a received run's `student -> elsewhere`
    or a hard-linked weights file is replaced, not written through. A kill midway leaves `.tmp-<name>-…` or
    `.old-<name>-…`, which `clean_run_leftovers` removes."""

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

    leftovers.remove_dead(Path(root), TEMPORARY)
