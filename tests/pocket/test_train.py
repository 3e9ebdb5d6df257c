"""`wandistiller.pocket.train`: the lr schedule's numbers; VAE and transformer steps on 4 tiny inputs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from wandistiller.core.arch import POCKET_VAE, TINY_TRANSFORMER
from wandistiller.pocket.train import cosine_lr, latent_moments, train_transformer, train_vae


def lr_at(step: int, steps: int, lr: float = 1.0, warmup: int = 50) -> float:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=123.0)
    cosine_lr(opt, step, steps, lr, warmup)
    return opt.param_groups[0]["lr"]


def tiny_transformer():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(2)
    return WanTransformer3DModel(**TINY_TRANSFORMER)


def tiny_vae():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(1)
    return AutoencoderKLWan(**POCKET_VAE)


class RecordingTransformer(nn.Module):
    """The real transformer, with the timesteps and text states of every call kept (to check what it was fed)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.timesteps, self.texts = inner, [], []

    def forward(self, x, t, text, return_dict=False):
        self.timesteps.append(t.detach())
        self.texts.append(text.detach())
        return self.inner(x, t, text, return_dict=return_dict)


def test_the_learning_rate_warms_up_then_follows_a_cosine_that_never_falls_below_5_percent():
    assert lr_at(0, 1000) == pytest.approx(0.05)  # 1/50 of the way up is below the floor
    assert lr_at(9, 1000) == pytest.approx(10 / 50 * 0.5 * (1 + math.cos(math.pi * 9 / 1000)))
    assert lr_at(49, 1000, lr=2e-3) == pytest.approx(2e-3 * 0.5 * (1 + math.cos(math.pi * 49 / 1000)))
    assert lr_at(500, 1000) == pytest.approx(0.5)  # half way down the cosine
    assert lr_at(999, 1000) == pytest.approx(0.05)  # the floor, not ~0
    assert lr_at(0, 4, warmup=1) == pytest.approx(1.0)


def test_latent_moments_are_the_posterior_modes_the_same_in_any_batch_size():
    vae, images = tiny_vae().eval(), torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    z = latent_moments(vae, images)
    assert z.shape == (4, 16, 1, 8, 8)  # the pocket VAE: 16 channels, 4x down
    assert torch.allclose(latent_moments(vae, images, batch=3), z, atol=1e-5)
    assert torch.equal(latent_moments(vae, images), z)  # the mode, not a sample


def test_a_vae_step_changes_the_weights_reproducibly_and_returns_it_frozen_for_encoding():
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    start = tiny_vae().state_dict()
    vae, again = (train_vae(tiny_vae(), images, steps=1, batch=2) for _ in range(2))
    trained = vae.state_dict()
    assert all(torch.equal(trained[k], again.state_dict()[k]) for k in start)  # seeded: the build is reproducible
    assert any(not torch.equal(start[k], trained[k]) for k in start)
    assert not vae.training and not any(p.requires_grad for p in vae.parameters())


def test_transformer_training_returns_the_frozen_ema_of_the_weights_from_a_fixed_seed():
    latents = torch.randn(4, 16, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    cond, uncond = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1)), torch.zeros(1, 8, 32)
    start = tiny_transformer().state_dict()
    runs = []
    for _ in range(2):
        transformer = tiny_transformer()
        ema = train_transformer(transformer, latents, cond, uncond, steps=1, batch=4)
        runs.append((transformer.state_dict(), ema))
    (trained, ema), (_, again) = runs
    assert not ema.training and not any(p.requires_grad for p in ema.parameters())
    assert all(torch.equal(a, b) for a, b in zip(ema.parameters(), again.parameters()))
    # The EMA moved from the start, but lags the trained weights: it is not the transformer itself.
    name = "proj_out.weight"
    assert not torch.equal(ema.state_dict()[name], start[name])
    assert not torch.equal(ema.state_dict()[name], trained[name])


def test_an_experts_training_sees_only_its_share_of_timesteps_and_a_tenth_of_prompts_dropped():
    latents = torch.randn(4, 16, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    cond, uncond = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1)), torch.zeros(1, 8, 32)
    recording = RecordingTransformer(tiny_transformer())
    train_transformer(recording, latents, cond, uncond, steps=2, batch=64, t_range=(875.0, 1000.0))
    timesteps, texts = torch.cat(recording.timesteps), torch.cat(recording.texts)
    assert timesteps.shape == (128,) and 875 <= float(timesteps.min()) and float(timesteps.max()) <= 1000
    dropped = (texts == 0).all(2).all(1).float().mean()  # the unconditional states in a prompt's place
    assert 0.03 < float(dropped) < 0.2


def test_the_end_frames_weight_changes_training_only_where_there_are_other_frames_to_weigh_against():
    cond, uncond = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1)), torch.zeros(1, 8, 32)

    def trained(frames: int, end_frames: float):
        latents = torch.randn(4, 16, frames, 4, 4, generator=torch.Generator().manual_seed(0))
        ema = train_transformer(tiny_transformer(), latents, cond, uncond, steps=1, batch=4, end_frames=end_frames)
        return ema.state_dict()["proj_out.weight"]

    # One latent frame is both ends: its weight, rescaled to a mean of 1, is 1 (the same step, to rounding).
    assert torch.allclose(trained(1, 3.0), trained(1, 1.0), atol=1e-6)
    assert not torch.allclose(trained(3, 3.0), trained(3, 1.0), atol=1e-6)
