"""Caches heal: a damaged chunk or embeddings file is made again with one line, never an internal error;
a teacher whose files were rewritten gets new cache keys; a full disk leaves no partial chunk."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from wandistiller.core.errors import UserError
from wandistiller.data.latents import _chunk_path, cached_bank
from wandistiller.data.prompts import _cache_key, encode_prompts
from wandistiller.teacher.model import inspect_teacher

SHAPE = (2, 1, 2, 2)


def make(calls):
    def make_chunk(items: range) -> torch.Tensor:
        calls.append(items.start)
        return torch.arange(items.start, items.stop, dtype=torch.float32).view(-1, 1, 1, 1, 1).expand(-1, *SHAPE)

    return make_chunk


def bank(folder, calls):
    return cached_bank(folder, 5, 2, 1, make(calls), "test latents", False, SHAPE)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "other_shape", "deleted", "manifest"])
def test_a_damaged_chunk_of_a_finished_cache_is_made_again(tmp_path, caplog, damage):
    folder, calls = tmp_path / "bank", []
    bank(folder, calls)
    assert calls == [0, 2, 4]
    chunk = _chunk_path(folder, 1)
    if damage == "truncated":
        chunk.write_bytes(chunk.read_bytes()[:50])
    elif damage == "garbage":
        chunk.write_bytes(b"garbage" * 10)
    elif damage == "other_shape":
        torch.save(torch.zeros(2, 3, 1, 2, 2), chunk)
    elif damage == "deleted":
        chunk.unlink()
    else:
        (folder / "complete.json").write_text("{not json")
    calls.clear()
    with caplog.at_level(logging.WARNING, logger="wandistiller.data.latents"):
        healed = bank(folder, calls)
    assert calls == ([2] if damage != "manifest" else [])
    assert healed.x0(torch.arange(5))[:, 0, 0, 0, 0].tolist() == [0, 1, 2, 3, 4]
    if damage in ("truncated", "garbage", "other_shape"):
        assert "chunk_000001.pt" in caplog.text and "damaged; making them again" in caplog.text


def test_a_full_disk_leaves_no_partial_chunk_and_is_one_line(tmp_path, monkeypatch):
    folder = tmp_path / "bank"

    def full(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)  # the disk, not a library we test: ENOSPC on write
    with pytest.raises(UserError, match=r"chunk_000000.pt cannot be written \(No space left on device\)"):
        bank(folder, [])
    assert not list(folder.iterdir())


def test_a_damaged_embeddings_cache_is_encoded_again(tiny_path, tmp_path, caplog):
    spec, cache = inspect_teacher(tiny_path), tmp_path / "cache"
    args = (["a fox", "a lighthouse"], "", 16, torch.float32, torch.device("cpu"), cache)
    first = encode_prompts(spec, *args)
    file = next((cache / "embeddings").glob("*.pt"))
    file.write_bytes(file.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="wandistiller.data.prompts"):
        again = encode_prompts(spec, *args)
    assert "is damaged; encoding the prompts again" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(first.embeds, again.embeds))
    torch.save({"prompts": ["other"], "embeds": [], "negative": torch.zeros(1, 4), "max_sequence_length": 16}, file)
    assert encode_prompts(spec, *args).prompts == ["a fox", "a lighthouse"]


def test_the_cache_keys_change_when_the_teachers_files_are_rewritten(tiny_path, tmp_path):
    folder = tmp_path / "teacher"
    shutil.copytree(tiny_path, folder)
    spec = inspect_teacher(folder)
    before = _cache_key(spec, ["a fox"], "", 16, torch.float32)
    weights = next((folder / "text_encoder").glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same size, rewritten later
    assert _cache_key(spec, ["a fox"], "", 16, torch.float32) != before


def test_encoding_embeddings_resumes_by_part_after_a_kill(tiny_path, tmp_path, caplog, monkeypatch):
    import wandistiller.data.prompts as data

    spec, cache = inspect_teacher(tiny_path), tmp_path / "cache"
    prompts = [f"prompt number {i}" for i in range(5)]
    args = (prompts, "", 16, torch.float32, torch.device("cpu"), cache)
    whole = encode_prompts(spec, *args)
    shutil.rmtree(cache)
    monkeypatch.setattr(data, "EMBED_CHUNK", 2)  # 3 parts: 2 + 2 + 1 prompts
    save, saved = data._save_atomically, []

    def killed_after_two_parts(obj, path):  # the process dies (kill -9) after two part files are on disk
        if len(saved) == 2:
            raise KeyboardInterrupt
        saved.append(path)
        save(obj, path)

    monkeypatch.setattr(data, "_save_atomically", killed_after_two_parts)
    with pytest.raises(KeyboardInterrupt):
        encode_prompts(spec, *args)
    monkeypatch.setattr(data, "_save_atomically", save)
    parts = sorted(p.name for p in saved)
    assert parts == ["part_000000.pt", "part_000001.pt"] and all(p.is_file() for p in saved)
    saved[1].write_bytes(saved[1].read_bytes()[:50])  # and the second part was damaged
    with caplog.at_level(logging.INFO, logger="wandistiller.data.prompts"):
        resumed = encode_prompts(spec, *args)
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "part_000001.pt" in warnings[0] and "encoding those prompts again" in warnings[0]
    assert "encoding 3 of 5 prompts" in caplog.text  # the first part was kept
    assert resumed.prompts == prompts and all(torch.equal(a, b) for a, b in zip(whole.embeds, resumed.embeds))
    assert not list((cache / "embeddings").glob("*.parts"))  # the whole file replaces the parts
