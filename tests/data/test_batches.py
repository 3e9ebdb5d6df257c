"""wandistiller/data/batches.py: batches as pure functions of (seed, step, micro-batch, rank), the same on any device,
Gaussian or drawn from a latent bank, and the source a run calls; on the tiny teacher's real embeddings."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.data.test_latents import PROMPTS, SHAPE, load
from wandistiller.data.batches import BatchSettings, batch_source, make_batch, mixed_seed, shifted_sigmas
from wandistiller.data.latents import teacher_latents
from wandistiller.data.prompts import encode_prompts, read_prompts
from wandistiller.teacher.spec import inspect_teacher


def batch(embeddings, seed=0, step=3, micro=0, rank=0, **settings):
    return make_batch(BatchSettings(seed, 4, (16, 1, 8, 8), 3.0, 1000, embeddings, **settings), step, micro, rank)


def embeddings(tiny_path, tmp_path):
    spec = inspect_teacher(tiny_path)
    return encode_prompts(spec, read_prompts(None), "", 512, torch.float32, torch.device("cpu"), tmp_path)


def test_batches_are_a_pure_function_of_seed_step_micro_rank(tiny_path, tmp_path):
    emb = embeddings(tiny_path, tmp_path)
    a, b = batch(emb), batch(emb)
    assert all(x is y is None or torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))
    for change in ({"seed": 1}, {"step": 4}, {"micro": 1}, {"rank": 1}):
        assert not torch.equal(batch(emb, **change).x_t, a.x_t), change
    assert ((a.t >= 0) & (a.t < 1000)).all()
    assert a.x0 is a.noise is None and torch.equal(batch(emb, keep_x0=True).x_t, a.x_t)


def test_the_flow_shift_moves_timesteps_towards_noise():
    u = torch.linspace(0, 0.999, 100)
    assert torch.equal(shifted_sigmas(u, 1.0), u)
    assert (shifted_sigmas(u, 3.0) >= u).all()
    # Wan 2.2's boundary t=875 at shift 3 falls at 1 - 0.875/(3 - 2*0.875) = 0.30 of the way through u.
    assert abs(float(shifted_sigmas(torch.tensor(0.7), 3.0)) - 0.875) < 1e-6


def test_batches_built_for_a_device_equal_the_cpu_ones_bit_for_bit(tiny_path, tmp_path):
    """The draws stay on the CPU whatever the device; only padding moves (checked here on the CPU device,
    the path CI has; on CUDA the same code adds pinned copies)."""
    emb = embeddings(tiny_path, tmp_path)
    a, b = batch(emb), batch(emb, device=torch.device("cpu"))
    assert all(x is y is None or torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))
    assert torch.equal(emb.padded(a.prompt_idx, torch.device("cpu")), emb.padded(a.prompt_idx))


def drawn(emb, step=3, **settings):
    return make_batch(BatchSettings(0, 4, SHAPE, 3.0, 1000, emb, **settings), step, micro=1, rank=2)


def test_the_gaussian_batch_is_unchanged(tiny_path, cache_dir):
    _, emb, _ = load(tiny_path, cache_dir)
    batch = drawn(emb)
    # The formulas as they were before latent banks existed: a resumed old run must see the same inputs.
    g = torch.Generator().manual_seed(mixed_seed(0, 3, 1, 2))
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
    a, b = drawn(emb, latent_bank=bank), drawn(emb, latent_bank=bank)
    assert all(x is y is None or torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))
    g = torch.Generator().manual_seed(mixed_seed(0, 3, 1, 2))
    items = torch.randint(len(bank), (4,), generator=g)
    noise, sigma = torch.randn((4, *SHAPE), generator=g), torch.rand(4, generator=g)
    s = (3.0 * sigma / (1 + 2.0 * sigma)).view(-1, 1, 1, 1, 1)
    assert torch.equal(a.prompt_idx, items // 2)  # the latent's own prompt...
    assert torch.equal(a.cond, emb.padded(items // 2))  # ...and its condition
    assert torch.equal(a.x_t, (1 - s) * bank.x0(items) + s * noise)
    assert not torch.equal(drawn(emb, latent_bank=bank, step=4).x_t, a.x_t)


def test_a_batch_source_gives_the_runs_batches_and_refuses_a_bank_of_another_shape(tiny_path, cache_dir, tmp_path):
    teacher, emb, settings = load(tiny_path, cache_dir)
    source = batch_source(BatchSettings(0, 4, SHAPE, 3.0, 1000, emb, keep_x0=True))
    made, expected = source(3, 1, 2), drawn(emb, keep_x0=True)
    assert all(x is y is None or torch.equal(x, y) for x, y in zip(vars(made).values(), vars(expected).values()))
    sigma = (made.t / 1000).view(-1, 1, 1, 1, 1)  # keep_x0: what x_t was mixed from, for a loss that needs it
    torch.testing.assert_close(made.x_t, (1 - sigma) * made.x0 + sigma * made.noise)
    bank = teacher_latents(teacher, emb, 0, settings, tmp_path, 4, False)
    other = (SHAPE[0], SHAPE[1], SHAPE[2] * 2, SHAPE[3])
    with pytest.raises(ValueError, match=r"latent bank holds .* latents, the run trains on"):
        batch_source(BatchSettings(0, 4, other, 3.0, 1000, emb, latent_bank=bank))
