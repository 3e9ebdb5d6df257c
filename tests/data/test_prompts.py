"""wandistiller/data/prompts.py: prompts files, and the embeddings cache (healed, resumed)."""

from __future__ import annotations

import gc
import logging
import os
import shutil

import pytest
import torch

from tests.conftest import refused
from wandistiller.core.errors import UserError
from wandistiller.data.prompts import _cache_key, encode_prompts, read_prompts
from wandistiller.teacher.spec import inspect_teacher


def test_the_shipped_prompts_are_many_and_varied():
    prompts = read_prompts(None)
    assert len(prompts) >= 64 and len(set(prompts)) == len(prompts)


@pytest.mark.parametrize(
    "content,message", [(None, "does not exist"), ("\n  \n", "holds no prompts"), (b"\xff\xfe\x00", "not UTF-8")]
)
def test_bad_prompts_files_are_refused_with_the_key(tmp_path, content, message):
    path = tmp_path / "prompts.txt"
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError, match=rf"data.prompts_path=.*{message}"):
        read_prompts(str(path))


def test_embeddings_are_computed_once_then_cached(tiny_path, tmp_path):
    spec = inspect_teacher(tiny_path)
    args = (spec, ["a red fox", "a lighthouse at night"], "", 512, torch.float32, torch.device("cpu"), tmp_path)
    first = encode_prompts(*args)
    files = list((tmp_path / "embeddings").glob("*.pt"))
    assert len(files) == 1
    second = encode_prompts(*args)
    assert all(torch.equal(a, b) for a, b in zip(first.embeds, second.embeds))
    assert first.embeds[0].shape == (4, 32)  # "a red fox" + </s>, trimmed; padded again per batch
    assert first.padded(torch.tensor([1, 0])).shape == (2, 512, 32)
    encode_prompts(spec, ["another prompt"], "", 512, torch.float32, torch.device("cpu"), tmp_path)
    assert len(list((tmp_path / "embeddings").glob("*.pt"))) == 2  # the key covers the prompts


def test_words_the_teachers_tokenizer_does_not_know_are_said_once_with_an_example(tiny_path, tmp_path, caplog):
    # A newcomer's: `generate --prompt "a fox in the snow"` on the pocket run drew a digit-like blob without a word.
    spec = inspect_teacher(tiny_path)
    asked = ["a red fox", "a red zzqx on a Qwoob."]
    with caplog.at_level(logging.WARNING):
        encode_prompts(spec, asked, "", 512, torch.float32, torch.device("cpu"), tmp_path)
    assert "1 of 2 prompts hold words the teacher's tokenizer does not know (zzqx, Qwoob in 'a red zzqx on" in (
        caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        encode_prompts(
            spec, ["a red fox", "a lighthouse at night"], "", 512, torch.float32, torch.device("cpu"), tmp_path
        )
    assert "does not know" not in caplog.text


def test_the_text_encoder_is_gone_when_the_embeddings_return(tiny_path, tmp_path):
    """A real teacher's text encoder is ~11 GB: it must be freed before the teacher loads, with or without a
    garbage-collector pass (gc off here, so a reference left behind shows)."""
    from transformers import PreTrainedModel

    def encoders() -> int:
        return sum(isinstance(o, PreTrainedModel) for o in gc.get_objects())

    spec = inspect_teacher(tiny_path)
    gc.collect()  # encoders other tests of this worker left to the collector: a pass inside would free them too
    before = encoders()
    gc.disable()
    try:
        encode_prompts(spec, ["a fox"], "", 16, torch.float32, torch.device("cpu"), tmp_path)
        assert encoders() == before
    finally:
        gc.enable()


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
    prompts = read_prompts(None)[:5]  # the shipped prompts: every word known to the tiny teacher
    args = (prompts, "", 16, torch.float32, torch.device("cpu"), cache)
    whole = encode_prompts(spec, *args)
    shutil.rmtree(cache)
    monkeypatch.setattr(data, "EMBED_CHUNK", 2)  # 3 parts: 2 + 2 + 1 prompts
    save, saved = data.save_tensors, []

    def killed_after_two_parts(obj, path):  # the process dies (kill -9) after two part files are on disk
        if len(saved) == 2:
            raise KeyboardInterrupt
        saved.append(path)
        save(obj, path)

    monkeypatch.setattr(data, "save_tensors", killed_after_two_parts)
    with pytest.raises(KeyboardInterrupt):
        encode_prompts(spec, *args)
    monkeypatch.setattr(data, "save_tensors", save)
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


def test_a_folder_as_prompts_path_is_named_a_folder_and_a_bom_is_dropped(tmp_path):
    from wandistiller.data.prompts import read_prompts

    with refused("is a folder; give a text file"):
        read_prompts(str(tmp_path))
    path = tmp_path / "p.txt"
    path.write_bytes("\ufeffa red fox\nsnow\n".encode())
    assert read_prompts(str(path)) == ["a red fox", "snow"]
    path.write_bytes(b"a\x00b\n")
    with refused("holds NUL bytes"):
        read_prompts(str(path))
    with refused("is not a regular file (a pipe or a device)"):
        read_prompts("/dev/null")


def test_a_slow_tokenizer_is_not_checked_for_unknown_words():
    # A review's: transformers 5's slow tokenizers ignore return_offsets_mapping; the check raised KeyError.
    from transformers import ByT5Tokenizer

    from wandistiller.data.prompts import unknown_words

    assert unknown_words(ByT5Tokenizer(), ["a red fox"]) == {}
