"""Files written whole or not at all, and one process at a time where processes share a folder.

A file written whole is a new file (O_EXCL, O_NOFOLLOW) named for its writer, flushed, then renamed over the name:
a reader, a run killed mid-write or a full disk never leaves half a file, and a link (symbolic or hard) in its place
is replaced, never written through. A dead writer's temporary is swept by the next writer (core/leftovers.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from wandistiller.core import leftovers
from wandistiller.core.errors import UserError

log = logging.getLogger(__name__)
# flock's answers on a file system that has no locks (some network and FUSE mounts): the work goes on unguarded.
NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


def flocked(fd: int, what: str, *, shared: bool = False, wait: bool = False) -> bool:
    """`fd` locked (exclusive, or `shared`); False where another process holds it (never when `wait`ing for it).
    Every lock in the package takes it, so each answers a lockless mount the same way: a warning naming `what` is
    no longer guarded, and True (the lock guards against a second writer, it does not forbid the work). Any other
    failure is one line naming `what`."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in NO_LOCKS:
            raise UserError(f"{what} cannot be locked ({e.strerror})") from None
        device = os.fstat(fd).st_dev
        if device not in _UNLOCKED_DEVICES:  # once a file system: a cache lock is taken at every cache miss
            _UNLOCKED_DEVICES.add(device)
            log.warning(
                "%s cannot be locked (%s): not guarded against a second writer at the same time", what, e.strerror
            )
        return True


_UNLOCKED_DEVICES: set[int] = set()  # the file systems flocked has warned about


@contextlib.contextmanager
def held_exclusively(lock_file: Path) -> Iterator[None]:
    """One process at a time in the block, across processes sharing a folder (two runs, a sweep's points, the
    ranks of a run): an exclusive flock on `lock_file`, released when the block ends or the process dies.
    The file stays: removing it while another process waits on it would let a third take a new one."""

    lock_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        flocked(fd, str(lock_file), wait=True)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def atomic_write(path: Path, data: str | bytes | None = None, *, write=None, fsync: bool = True) -> Path:
    """`path` written whole or not at all: into a temporary sibling, flushed, then renamed over it, so a reader
    (or a run killed mid-write, or a full disk) never leaves half a file. Give the text or bytes, or
    `write(file)` that writes into the open binary file (torch.save, a figure's savefig)."""
    path = Path(path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        write_whole_at(dfd, path.name, data, write, fsync)
    finally:
        os.close(dfd)
    return path


# `atomic_write`'s temporary names: `.<name>.<8 hex>.tmp-<host>-<pid>` (core/leftovers: a dead writer's is swept).
ATOMIC_TMP = r"\..+\.[0-9a-f]{8}\.tmp"


def write_whole_at(dfd: int, name: str, data, write, fsync: bool) -> None:
    """`name` in the folder open as `dfd`, written whole: a new file (O_EXCL, O_NOFOLLOW: never an existing file or
    link) named for its writer, renamed over `name` -- a link (symbolic or hard) in its place is replaced."""

    tmp = leftovers.owned_name(f".{name}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        with os.fdopen(fd, "wb") as f:
            if write is not None:
                write(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data or b"")
            f.flush()
            if fsync:
                os.fsync(f.fileno())
            os.fchmod(f.fileno(), 0o666 & ~umask())  # what open() would have given it
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise


def save_tensors(obj, path: Path) -> Path:
    """`torch.save(obj)` at `path` (its folder made), whole or not at all (`atomic_write`): a reader never sees half
    a cache file, and a failed write (a full disk) leaves no partial file and is one line naming the file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    leftovers.remove_dead(path.parent, ATOMIC_TMP)  # a killed writer's half file, never a live writer's
    try:
        return atomic_write(path, write=lambda f: torch.save(obj, f))
    except (OSError, RuntimeError) as e:  # torch.save reports ENOSPC as a RuntimeError from its zip writer
        raise UserError(
            f"the cache file {path} cannot be written ({getattr(e, 'strerror', None) or str(e).splitlines()[0]}); "
            "free some space, or set paths.cache_dir=… to another disk"
        ) from None


def umask() -> int:
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
