"""wandistiller/data/latents.py: teacher latents equal WanPipeline's; their chunk cache keyed, resumed, healed."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from diffusers import WanPipeline
from omegaconf import OmegaConf

from tests.conftest import FP32
from wandistiller.core.distributed import Topology
from wandistiller.core.errors import UserError
from wandistiller.data import latents
from wandistiller.data.latents import (
    SamplerSettings,
    _chunk_path,
    cache_key,
    cached_bank,
    latents_folder,
    load_latent_bank,
    noise_for,
    teacher_latents,
)
from wandistiller.data.prompts import encode_prompts
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.teacher.spec import inspect_teacher

PROMPTS = ["a red fox in snow", "a lighthouse at night", "a bowl of ramen", "a sailboat at dawn", "a city in rain"]
SHAPE = (16, 1, 8, 8)


def load(path, cache_dir, scales=(4.0, 3.0)):
    spec = inspect_teacher(path)
    cfg = OmegaConf.create({"guidance_scale": scales[0], "guidance_scale_2": scales[1]})
    teacher = CpuPlacement().load(spec, cfg, FP32, Topology())
    emb = encode_prompts(spec, PROMPTS, "", 512, torch.float32, torch.device("cpu"), cache_dir)
    settings = SamplerSettings(steps=4, guidance_scales=tuple(teacher.guidance_scales), latent_shape=SHAPE)
    return teacher, emb, settings


@pytest.mark.parametrize("which", ["tiny", "tiny_moe"])
def test_teacher_latents_equal_wan_pipeline_output_type_latent(which, tiny_path, tiny_moe_path, cache_dir, tmp_path):
    path = tiny_path if which == "tiny" else tiny_moe_path
    teacher, emb, settings = load(path, cache_dir)
    settings = dataclasses.replace(settings, latents_per_prompt=2)
    bank = teacher_latents(teacher, emb, 7, settings, tmp_path, chunk_size=3, progress=False)
    assert len(bank) == 2 * len(PROMPTS) and bank.prompt_idx.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    pipe = WanPipeline.from_pretrained(path, dtype=torch.float32, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    for j in (0, 3, 9):  # first and last chunk, and a second sample of a prompt
        prompt, k = divmod(j, 2)
        expected = pipe(
            PROMPTS[prompt],
            latents=noise_for(7, prompt, k, SHAPE)[None],
            num_frames=1,
            height=64,
            width=64,
            num_inference_steps=4,
            guidance_scale=4.0,
            guidance_scale_2=3.0 if which == "tiny_moe" else None,
            output_type="latent",
        ).frames
        # Batched with other prompts here, alone there: equal up to kernel rounding.
        torch.testing.assert_close(bank.x0(torch.tensor([j])), expected, rtol=1e-4, atol=1e-4)


def test_the_cache_is_reused_and_keyed_by_every_part(tiny_path, cache_dir, tmp_path, monkeypatch):
    teacher, emb, settings = load(tiny_path, cache_dir)
    first = teacher_latents(teacher, emb, 0, settings, tmp_path, chunk_size=2, progress=False)

    def no_generation(*a, **k):
        raise AssertionError("a complete cache must not generate")

    monkeypatch.setattr(latents, "_generate_chunk", no_generation)
    again = teacher_latents(teacher, emb, 0, settings, tmp_path, chunk_size=2, progress=False)
    assert torch.equal(again.x0(torch.arange(len(first))), first.x0(torch.arange(len(first))))
    # A rank without a teacher finds the same cache from the spec alone.
    folder = latents_folder(teacher.spec, emb, 0, settings, torch.float32, tmp_path)
    assert torch.equal(load_latent_bank(folder).x0(torch.arange(len(first))), first.x0(torch.arange(len(first))))

    key = cache_key(teacher.spec, emb, 0, settings, torch.float32)
    other_emb = encode_prompts(teacher.spec, PROMPTS[:4], "", 512, torch.float32, torch.device("cpu"), cache_dir)
    changed = [
        cache_key(teacher.spec, emb, 1, settings, torch.float32),
        cache_key(teacher.spec, other_emb, 0, settings, torch.float32),
        cache_key(teacher.spec, emb, 0, settings, torch.bfloat16),
        *(
            cache_key(teacher.spec, emb, 0, dataclasses.replace(settings, **change), torch.float32)
            for change in (
                {"steps": 5},
                {"guidance_scales": (5.0,)},
                {"latent_shape": (16, 1, 8, 16)},
                {"latents_per_prompt": 2},
            )
        ),
    ]
    assert key not in changed and len(set(changed)) == len(changed)
    with pytest.raises(AssertionError, match="must not generate"):  # a new key does generate
        teacher_latents(teacher, emb, 1, settings, tmp_path, chunk_size=2, progress=False)


def test_an_interrupted_generation_keeps_its_chunks_and_is_never_used_as_complete(
    tiny_path, cache_dir, tmp_path, monkeypatch
):
    teacher, emb, settings = load(tiny_path, cache_dir)
    real, made = latents._generate_chunk, []

    def interrupted_after_two(teacher, pipe, emb, seed, settings, items):
        if len(made) == 2:
            raise KeyboardInterrupt
        made.append(items)
        return real(teacher, pipe, emb, seed, settings, items)

    monkeypatch.setattr(latents, "_generate_chunk", interrupted_after_two)
    with pytest.raises(KeyboardInterrupt):
        teacher_latents(teacher, emb, 0, settings, tmp_path / "a", chunk_size=2, progress=False)
    folder = next((tmp_path / "a" / "teacher_latents").iterdir())
    assert sorted(p.name for p in folder.iterdir()) == ["chunk_000000.pt", "chunk_000001.pt"]
    assert load_latent_bank(folder) is None

    made.clear()
    monkeypatch.setattr(latents, "_generate_chunk", lambda *a: (made.append(a[-1]), real(*a))[1])
    resumed = teacher_latents(teacher, emb, 0, settings, tmp_path / "a", chunk_size=2, progress=False)
    assert made == [range(4, 5)]  # only the missing chunk
    fresh = teacher_latents(teacher, emb, 0, settings, tmp_path / "b", chunk_size=2, progress=False)
    assert torch.equal(resumed.x0(torch.arange(5)), fresh.x0(torch.arange(5)))


CHUNK_SHAPE = (2, 1, 2, 2)  # the chunk-cache tests' latents


def make(calls):
    def make_chunk(items: range) -> torch.Tensor:
        calls.append(items.start)
        return torch.arange(items.start, items.stop, dtype=torch.float32).view(-1, 1, 1, 1, 1).expand(-1, *CHUNK_SHAPE)

    return make_chunk


def bank(folder, calls):
    return cached_bank(folder, 5, 2, 1, make(calls), "test latents", False, CHUNK_SHAPE)


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


def test_the_cache_key_changes_with_the_teachers_lora_file_and_strength(tiny_path, cache_dir, tmp_path):
    """A fine-tuned teacher (teacher.lora) never reuses the plain teacher's cached latents or ODE points (trajectories
    key on this too), nor another LoRA's or another strength's; the plain teacher's key is as before."""
    from safetensors.torch import save_file

    from tests.teacher.test_finetune import peft_state
    from wandistiller.teacher.finetune import with_loras

    spec = inspect_teacher(tiny_path)
    emb = encode_prompts(spec, PROMPTS, "", 512, torch.float32, torch.device("cpu"), cache_dir)
    settings = SamplerSettings(steps=4, guidance_scales=(4.0,), latent_shape=SHAPE)
    for seed in (0, 1):
        save_file(peft_state(spec.transformer_config, seed), tmp_path / f"style{seed}.safetensors")
    key = lambda s: cache_key(s, emb, 0, settings, torch.float32)
    one = lambda seed, strength: [{"path": str(tmp_path / f"style{seed}.safetensors"), "strength": strength}]
    keys = [key(spec)] + [
        key(with_loras(spec, one(seed, strength))) for seed, strength in ((0, 1.0), (0, 0.5), (1, 1.0))
    ]
    assert len(set(keys)) == 4
    assert key(with_loras(spec, None)) == keys[0] and key(with_loras(spec, one(0, 1.0))) == keys[1]  # stable
