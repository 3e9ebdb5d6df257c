"""wandistiller/data/prompts.py: prompts files, the embeddings cache (healed, resumed), batches as pure functions."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil

import pytest
import torch

from tests.conftest import refused
from tests.data.test_latents import PROMPTS, SHAPE, load
from wandistiller.core.errors import UserError
from wandistiller.data.latents import teacher_latents
from wandistiller.data.prompts import _cache_key, _mix, encode_prompts, make_batch, read_prompts, shifted_sigmas
from wandistiller.teacher.model import inspect_teacher


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


def batch(embeddings, **kw):
    args = (
        dict(
            seed=0,
            step=3,
            micro=0,
            rank=0,
            batch_size=4,
            latent_shape=(16, 1, 8, 8),
            flow_shift=3.0,
            num_train_timesteps=1000,
            embeddings=embeddings,
        )
        | kw
    )
    return make_batch(**args)


def test_batches_are_a_pure_function_of_seed_step_micro_rank(tiny_path, tmp_path):
    spec = inspect_teacher(tiny_path)
    emb = encode_prompts(spec, read_prompts(None), "", 512, torch.float32, torch.device("cpu"), tmp_path)
    a, b = batch(emb), batch(emb)
    assert all(x is y is None or torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))
    for change in ({"seed": 1}, {"step": 4}, {"micro": 1}, {"rank": 1}):
        assert not torch.equal(batch(emb, **change).x_t, a.x_t), change
    assert ((a.t >= 0) & (a.t < 1000)).all()


def test_the_flow_shift_moves_timesteps_towards_noise():
    u = torch.linspace(0, 0.999, 100)
    assert torch.equal(shifted_sigmas(u, 1.0), u)
    assert (shifted_sigmas(u, 3.0) >= u).all()
    # Wan 2.2's boundary t=875 at shift 3 falls at 1 - 0.875/(3 - 2*0.875) = 0.30 of the way through u.
    assert abs(float(shifted_sigmas(torch.tensor(0.7), 3.0)) - 0.875) < 1e-6


def test_batches_built_for_a_device_equal_the_cpu_ones_bit_for_bit(tiny_path, tmp_path):
    """The draws stay on the CPU whatever the device; only padding moves (checked here on the CPU device,
    the path CI has; on CUDA the same code adds pinned copies)."""
    spec = inspect_teacher(tiny_path)
    emb = encode_prompts(spec, read_prompts(None), "", 512, torch.float32, torch.device("cpu"), tmp_path)
    a, b = batch(emb), batch(emb, device=torch.device("cpu"))
    assert all(x is y is None or torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))
    assert torch.equal(emb.padded(a.prompt_idx, torch.device("cpu")), emb.padded(a.prompt_idx))


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


def batch_args(emb, **kw):
    args = dict(seed=0, step=3, micro=1, rank=2, batch_size=4, latent_shape=SHAPE, flow_shift=3.0)
    return args | dict(num_train_timesteps=1000, embeddings=emb) | kw


def test_the_gaussian_batch_is_unchanged(tiny_path, cache_dir):
    _, emb, _ = load(tiny_path, cache_dir)
    batch = make_batch(**batch_args(emb))
    # The formulas as they were before latent banks existed: a resumed old run must see the same inputs.
    g = torch.Generator().manual_seed(_mix(0, 3, 1, 2))
    prompt_idx = torch.randint(len(PROMPTS), (4,), generator=g)
    x0, noise = torch.randn((4, *SHAPE), generator=g), torch.randn((4, *SHAPE), generator=g)
    u = torch.rand(4, generator=g)
    sigma = 3.0 * u / (1 + 2.0 * u)
    s = sigma.view(-1, 1, 1, 1, 1)
    assert torch.equal(batch.prompt_idx, prompt_idx) and torch.equal(batch.t, sigma * 1000)
    assert torch.equal(batch.x_t, (1 - s) * x0 + s * noise)


def test_a_bank_batch_draws_x0_and_its_own_prompt_as_a_pure_function(tiny_path, cache_dir, tmp_path):
    teacher, emb, settings = load(tiny_path, cache_dir)
    bank = teacher_latents(teacher, emb, 0, dataclasses.replace(settings, latents_per_prompt=2), tmp_path, 4, False)
    a, b = make_batch(**batch_args(emb, latent_bank=bank)), make_batch(**batch_args(emb, latent_bank=bank))
    assert all(x is y is None or torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))
    g = torch.Generator().manual_seed(_mix(0, 3, 1, 2))
    items = torch.randint(len(bank), (4,), generator=g)
    noise, sigma = torch.randn((4, *SHAPE), generator=g), torch.rand(4, generator=g)
    s = (3.0 * sigma / (1 + 2.0 * sigma)).view(-1, 1, 1, 1, 1)
    assert torch.equal(a.prompt_idx, items // 2)  # the latent's own prompt...
    assert torch.equal(a.cond, emb.padded(items // 2))  # ...and its condition
    assert torch.equal(a.x_t, (1 - s) * bank.x0(items) + s * noise)
    assert not torch.equal(make_batch(**batch_args(emb, latent_bank=bank, step=4)).x_t, a.x_t)


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
