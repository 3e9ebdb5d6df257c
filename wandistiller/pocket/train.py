"""Training the pocket teacher's parts on the CPU: its VAE (reconstruction + a little KL) and its
transformers (rectified-flow velocity on the VAE's latents, 10% of prompts dropped for CFG, EMA weights)."""

from __future__ import annotations

import copy
import logging
import math

import torch
import torch.nn.functional as F

from wandistiller.data.batches import shifted_sigmas

log = logging.getLogger(__name__)


def cosine_lr(opt, step: int, steps: int, lr: float, warmup: int = 50) -> None:
    scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
    for group in opt.param_groups:
        group["lr"] = lr * max(scale, 0.05)


def train_vae(
    vae, images: torch.Tensor, steps: int, batch: int = 32, lr: float = 2e-3, kl: float = 1e-4, seed: int = 0
):
    """Fit `vae` (AutoencoderKLWan) to [N, 3, H, W] images in [0, 1]; returns it in eval mode."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(vae.parameters(), lr, weight_decay=0.0)
    vae.train()
    for step in range(steps):
        x = images[torch.randint(len(images), (batch,), generator=g)][:, :, None] * 2 - 1
        posterior = vae.encode(x).latent_dist
        rec = _unclamped_decode(vae, posterior.sample(generator=g))
        kl_term = 0.5 * (posterior.mean.pow(2) + posterior.var - 1 - posterior.logvar).mean()
        loss = F.mse_loss(rec, x) + kl * kl_term
        cosine_lr(opt, step, steps, lr)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 100 == 0:
            log.info("vae step %d/%d recon %.5f kl %.3f", step + 1, steps, float(loss - kl * kl_term), float(kl_term))
    return vae.eval().requires_grad_(False)


def _unclamped_decode(vae, z: torch.Tensor) -> torch.Tensor:
    """AutoencoderKLWan's one-frame decode without its final clamp to [-1, 1]: through the clamp a channel whose
    output falls below -1 (black background) gets no gradient and dies (the red channel did, at first)."""
    vae.clear_cache()
    vae._conv_idx = [0]
    out = vae.decoder(vae.post_quant_conv(z), feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=True)
    vae.clear_cache()
    return out


@torch.no_grad()
def latent_moments(vae, images: torch.Tensor, batch: int = 128) -> torch.Tensor:
    """The posterior modes (un-normalised) of [N, 3, H, W] images in [0, 1]: [N, C, 1, h, w]."""
    rows = [
        vae.encode(images[i : i + batch][:, :, None] * 2 - 1).latent_dist.mode() for i in range(0, len(images), batch)
    ]
    return torch.cat(rows)


def flow_batch(
    latents,
    cond,
    uncond,
    batch: int,
    g: torch.Generator,
    sigma_range=(0.0, 1.0),
    shift: float = 3.0,
    condition: torch.Tensor | None = None,
):
    """One rectified-flow batch drawn with `g` (the pocket teacher's objective and its style LoRA's, the draws in
    one fixed order, so the shipped weights rebuild bit for bit): (noisy latents at sigma, timesteps 1000 * sigma,
    text states with 10% of them dropped to `uncond` for CFG, the velocity target noise - x0). `condition`: an
    image-to-video teacher's per-item conditioning [N, c, F, h, w] (first-frame mask and image latents), concatenated
    to the noisy latents on the channels as WanImageToVideoPipeline feeds it; never dropped (its CFG drops the text
    alone), and drawn after everything else, so the text-to-video teachers' draws are as they were."""
    lo, hi = sigma_range
    idx = torch.randint(len(latents), (batch,), generator=g)
    x0, noise = latents[idx], torch.randn(latents[idx].shape, generator=g)
    sigma = lo + (hi - lo) * shifted_sigmas(torch.rand(batch, generator=g), shift)
    s = sigma.view(-1, 1, 1, 1, 1)
    drop = (torch.rand(batch, generator=g) < 0.1).view(-1, 1, 1)
    text = torch.where(drop, uncond.expand(batch, -1, -1), cond[idx])
    noisy = (1 - s) * x0 + s * noise
    if condition is not None:
        noisy = torch.cat([noisy, condition[idx]], dim=1)
    return noisy, sigma * 1000, text, noise - x0


def train_transformer(
    transformer,
    latents: torch.Tensor,
    cond: torch.Tensor,
    uncond: torch.Tensor,
    steps: int,
    t_range: tuple[float, float] = (0.0, 1000.0),
    batch: int = 128,
    lr: float = 1e-3,
    shift: float = 3.0,
    seed: int = 0,
    condition: torch.Tensor | None = None,
    end_frames: float = 1.0,
):
    """Rectified flow on normalised `latents` [N, C, F, h, w] with per-item text states `cond` [N, L, D] (and an
    image-to-video teacher's per-item `condition`: `flow_batch`): velocity noise - x0 at t = 1000 * sigma (Wan's
    shifted schedule), limited to `t_range` (one expert's share). `end_frames`: the first and last latent frames'
    weight in the loss against the others' 1 (the weights rescaled to a mean of 1). Returns the EMA of the weights
    (what samples best), in eval mode."""
    g = torch.Generator().manual_seed(seed)
    ema = copy.deepcopy(transformer).requires_grad_(False)
    opt = torch.optim.AdamW(transformer.parameters(), lr, weight_decay=0.0)
    lo, hi = t_range[0] / 1000, t_range[1] / 1000
    ends = torch.ones(latents.shape[2])
    ends[[0, -1]] = end_frames
    weight = None if end_frames == 1 else (ends / ends.mean()).view(1, 1, -1, 1, 1)
    transformer.train()
    for step in range(steps):
        noisy, t, text, velocity = flow_batch(latents, cond, uncond, batch, g, (lo, hi), shift, condition)
        pred = transformer(noisy, t, text, return_dict=False)[0]
        # Unweighted, the image teacher's own loss (its shipped bytes rebuild only through the same arithmetic).
        loss = F.mse_loss(pred, velocity) if weight is None else ((pred - velocity) ** 2 * weight).mean()
        cosine_lr(opt, step, steps, lr)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        decay = min(0.999, (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(ema.parameters(), transformer.parameters()):
                e.lerp_(p, 1 - decay)
        if (step + 1) % 100 == 0:
            log.info("transformer step %d/%d loss %.4f", step + 1, steps, float(loss))
    return ema.eval()
