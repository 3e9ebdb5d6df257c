"""Teacher latents: WanPipeline's own samples, cached by everything that shapes them, resumable by chunk."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from diffusers import WanPipeline
from omegaconf import OmegaConf

from tests.conftest import FP32
from wandistiller.core.distributed import Topology
from wandistiller.data import latents
from wandistiller.data.latents import (
    SamplerSettings,
    cache_key,
    latents_folder,
    load_latent_bank,
    noise_for,
    teacher_latents,
)
from wandistiller.data.prompts import _mix, encode_prompts, make_batch
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.teacher.model import inspect_teacher

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
