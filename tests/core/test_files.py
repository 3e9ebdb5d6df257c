"""`wandistiller.core.files`: safetensors headers told whole or damaged, folders that cannot be written, atomic writes
(of text, and of tensors: save_tensors); called directly on tiny real files in a temporary folder."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from safetensors.torch import save_file

from tests.teacher.test_spec import WEIGHTS
from wandistiller.core.errors import UserError
from wandistiller.core.files import atomic_write, file_stamps, folder_problem, safetensors_problem, save_tensors


@pytest.fixture
def weights(tmp_path):
    """A whole safetensors file of two tiny tensors, with metadata."""
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}, path, metadata={"format": "pt"})
    return path


def test_a_whole_safetensors_file_has_no_problem_and_a_truncated_one_says_so(weights):
    assert safetensors_problem(weights) is None
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-1])  # one byte of data short
    assert "truncated or damaged" in safetensors_problem(weights)
    weights.write_bytes(whole[:100])  # cut inside the header
    assert "its header claims" in safetensors_problem(weights)
    weights.write_bytes(b"")
    assert safetensors_problem(weights) == f"{weights} is 0 bytes, too short to be a safetensors file (truncated or " \
        "empty)"  # fmt: skip


def test_a_header_that_is_not_safetensors_is_named_for_what_is_wrong(tmp_path):
    def file_with_header(text: str, data: bytes = b"") -> str | None:
        path = tmp_path / "x.safetensors"
        path.write_bytes(len(text).to_bytes(8, "little") + text.encode() + data)
        return safetensors_problem(path)

    assert "its header is not JSON" in file_with_header("{not json")
    assert "not a JSON object" in file_with_header("[1, 2]")
    assert "tensor 'w' has no dtype/shape/data_offsets" in file_with_header('{"w": {"dtype": "F32"}}')
    span = '{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}'  # 2 floats need 8 bytes
    assert "tensor 'w' spans 4 bytes, its shape needs 8" in file_with_header(span, b"\0" * 4)
    assert safetensors_problem(tmp_path / "missing.safetensors").endswith("cannot be read (No such file or directory)")


def test_a_folder_that_can_be_made_has_no_problem_and_one_through_a_file_or_a_dead_link_has(tmp_path):
    assert folder_problem(tmp_path / "new" / "deeper") is None  # need not exist yet
    (tmp_path / "afile").write_text("x")
    assert folder_problem(tmp_path / "afile") == f"{tmp_path / 'afile'} is a file"
    assert folder_problem(tmp_path / "afile" / "run") == f"{tmp_path / 'afile' / 'run'} runs through " \
        f"{tmp_path / 'afile'}, which is a file"  # fmt: skip
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    assert folder_problem(tmp_path / "link" / "run") == f"{tmp_path / 'link'} is a broken symbolic link"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a folder without write permission")
def test_a_folder_without_write_permission_is_named(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        assert folder_problem(locked / "run") == f"{locked} cannot be written (no write permission)"
    finally:
        locked.chmod(0o755)


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


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_file_stamps_name_size_and_change_when_a_file_is_rewritten(tmp_path):
    (tmp_path / "b.safetensors").write_bytes(b"12")
    (tmp_path / "a.safetensors").write_bytes(b"1")
    (tmp_path / "notes.txt").write_text("not matched")
    before = file_stamps(tmp_path, "*.safetensors")
    assert [(name, size) for name, size, _ in before] == [("a.safetensors", 1), ("b.safetensors", 2)]
    os.utime(tmp_path / "a.safetensors", ns=(before[0][2] + 10**9,) * 2)  # a rebuild at a later time
    assert file_stamps(tmp_path, "*.safetensors") != before


def test_a_good_safetensors_file_passes_the_header_check(tiny_path):
    assert safetensors_problem(tiny_path / WEIGHTS) is None


def test_a_read_only_folder_is_named_read_only(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)],
                                                   capture_output=True).returncode == 0  # fmt: skip
    if not mounted:
        folder.chmod(0o555)
        if os.access(folder, os.W_OK):
            pytest.skip("neither a read-only mount nor a read-only folder can be made here")
    try:
        assert "cannot be written" in folder_problem(folder / "run")
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)


def test_files_written_whole_keep_the_mode_open_would_give_them(tmp_path):
    import os

    from wandistiller.core.files import atomic_write

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

    from wandistiller.core.files import held_exclusively

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
