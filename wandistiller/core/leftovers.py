"""Temporary folders named for their owner process, and the cleanup of those whose owner is gone.

Every temporary folder this project writes (a checkpoint being saved, the tiny teacher being built, the
`disk` placement's conversion) is named `<prefix>-<host>-<pid>`. A process killed mid-write leaves it
behind; the next start removes it -- but only a name one of our patterns matches, and only when the pid
is dead on this host. A folder from another host (a shared file system) is never touched: its owner
cannot be checked from here.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
from pathlib import Path

log = logging.getLogger(__name__)
HOST = socket.gethostname()


def owned_name(prefix: str) -> str:
    """`<prefix>-<host>-<pid>`: a temporary name the cleanup can trace back to this process."""
    return f"{prefix}-{HOST}-{os.getpid()}"


def owner(name: str, pattern: str) -> tuple[str, int] | None:
    """(host, pid) of a name made by `owned_name` from a prefix matching the regex `pattern`, else None."""
    found = re.fullmatch(rf"(?:{pattern})-(.+)-(\d+)", name)
    return (found[1], int(found[2])) if found else None


def alive(host: str, pid: int) -> bool:
    """Whether the owner may still be writing. Unknown (another host) counts as alive."""
    if host != HOST:
        return True
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_dead(parent: Path, pattern: str) -> list[Path]:
    """Remove the entries of `parent` named `<pattern>-<host>-<pid>` whose owner is gone; return them."""
    removed: list[Path] = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:  # not there (yet), or not readable: nothing of ours to clean
        return removed
    for entry in entries:
        found = owner(entry.name, pattern)
        if found is None or alive(*found):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        log.info("removed %s, left by process %d that is gone", entry, found[1])
        removed.append(entry)
    return removed
