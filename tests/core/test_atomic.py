"""`wandistiller.core.atomic`: files written whole or not at all (text, and tensors: save_tensors), with the mode
open() would give them, a killed writer's temporary swept, and one holder of a lock at a time."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
from pathlib import Path

import pytest
import torch

from wandistiller.core import atomic
from wandistiller.core.atomic import atomic_write, flocked, held_exclusively, save_tensors
from wandistiller.core.errors import UserError


def test_atomic_write_replaces_whole_with_open_permissions_and_leaves_nothing_when_the_writer_fails(tmp_path):
    path = atomic_write(tmp_path / "a.json", "old", fsync=False)
    assert path.read_text() == "old" and path.stat().st_mode & 0o777 == 0o666 & ~_current_umask()
    atomic_write(path, b"bytes")
    assert path.read_bytes() == b"bytes"

    def half_then_fail(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, write=half_then_fail)
    assert path.read_bytes() == b"bytes" and [p.name for p in tmp_path.iterdir()] == ["a.json"]  # no temporary left


def test_save_tensors_makes_the_folder_and_a_full_disk_is_one_line_leaving_no_file(tmp_path, monkeypatch):
    path = save_tensors({"embeds": [torch.arange(3.0)], "prompts": ["a fox"]}, tmp_path / "new" / "cache.pt")
    found = torch.load(path, weights_only=True)
    assert found["prompts"] == ["a fox"] and torch.equal(found["embeds"][0], torch.arange(3.0))

    def full(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)  # the disk, not a library we test: ENOSPC on write
    with pytest.raises(UserError, match=r"other.pt cannot be written \(No space left on device\); free some") as e:
        save_tensors(torch.zeros(2), tmp_path / "new" / "other.pt")
    assert "\n" not in str(e.value) and [p.name for p in (tmp_path / "new").iterdir()] == ["cache.pt"]


def test_files_written_whole_keep_the_mode_open_would_give_them(tmp_path):
    import os

    from wandistiller.core.atomic import atomic_write

    old = os.umask(0o022)
    try:
        assert atomic_write(tmp_path / "metrics.json", "{}").stat().st_mode & 0o777 == 0o644  # not 0600
        os.umask(0o077)
        assert atomic_write(tmp_path / "private.json", "{}").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_held_exclusively_lets_one_holder_in_at_a_time_and_frees_the_lock_when_it_leaves(tmp_path):
    import threading
    import time

    from wandistiller.core.atomic import held_exclusively

    lock, events, inside = tmp_path / "cache" / "key.lock", [], threading.Event()

    def first():
        with held_exclusively(lock):
            inside.set()
            time.sleep(0.2)  # long enough for the second to be waiting on the lock
            events.append("first leaves")

    thread = threading.Thread(target=first)
    thread.start()
    inside.wait()
    with held_exclusively(lock):  # a descriptor of its own: flock makes it wait like another process
        events.append("second enters")
    thread.join()
    assert events == ["first leaves", "second enters"] and lock.is_file()
    with held_exclusively(lock):  # free again once both left
        pass


def test_a_cache_writer_killed_mid_write_leaves_a_file_the_next_writer_sweeps_and_a_live_ones_stays(tmp_path):
    """kill -9 during atomic_write (a cache chunk, the prompt embeddings) leaves `.<name>.<hex>.tmp-<host>-<pid>`;
    the next save into that cache folder removes it (its writer is dead), never a live writer's."""
    import signal
    import sys

    from wandistiller.core import leftovers

    cache = tmp_path / "cache" / "latents"
    cache.mkdir(parents=True)
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from wandistiller.core.atomic import atomic_write\n"
        "def slow(f):\n    f.write(b'half'); f.flush(); print('writing', flush=True); time.sleep(60)\n"
        f"atomic_write(Path({str(cache)!r}) / 'chunk_000000.pt', write=slow)"
    )], stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert writer.stdout is not None and writer.stdout.readline() == b"writing\n"
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    (orphan,) = cache.iterdir()
    assert orphan.name.startswith(".chunk_000000.pt.") and orphan.name.endswith(f".tmp-{leftovers.HOST}-{writer.pid}")
    live = cache / leftovers.owned_name(".chunk_000001.pt.0123abcd.tmp")  # this process's: alive
    live.write_bytes(b"being written")
    save_tensors(torch.zeros(2), cache / "chunk_000002.pt")
    assert sorted(p.name for p in cache.iterdir()) == sorted([live.name, "chunk_000002.pt"])


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def no_locks(monkeypatch, error: int = errno.ENOLCK) -> None:
    """flock as a file system without locks answers it (some NFS and FUSE mounts)."""

    def refuse(fd, op):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(fcntl, "flock", refuse)
    monkeypatch.setattr(atomic, "_UNLOCKED_DEVICES", set())  # each test's warning is its own


@pytest.mark.parametrize("error", [errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS])
def test_every_lock_on_a_file_system_without_locks_goes_on_unguarded_and_says_what(
    tmp_path, monkeypatch, caplog, error
):
    """One answer for every lock in the package (run folder, export, build, cache writers): the work goes on, with a
    warning naming what is no longer guarded; another failure is one line."""
    no_locks(monkeypatch, error)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        assert flocked(fd, "the thing") is True
        assert "the thing cannot be locked" in caplog.text and "not guarded against a second writer" in caplog.text
        caplog.clear()
        with held_exclusively(tmp_path / "cache.lock"):  # a cache writer waits on none, and says it once
            pass
        assert "cannot be locked" not in caplog.text
        no_locks(monkeypatch, errno.EBADF)
        with pytest.raises(UserError, match=r"^the thing cannot be locked \(Bad file descriptor\)$"):
            flocked(fd, "the thing")
    finally:
        os.close(fd)
