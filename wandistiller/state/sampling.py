"""Sampling a run's teacher or student for eval, generate and the quality reports: the counts and image sizes asked
checked before any work, the image and time factors of the teacher's VAE, the teacher loaded whole, and `generate`
(through WanPipeline, or an image-to-video teacher's own pipeline)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from wandistiller.core.errors import UserError
from wandistiller.core.files import read_json_in
from wandistiller.data.latents import SamplerSettings, noise_for, sample_latents, teacher_pipeline
from wandistiller.placements.base import load_teacher as load_whole
from wandistiller.state.runs import RunFolder
from wandistiller.teacher.model import Teacher
from wandistiller.teacher.sampler import image_pipeline


def check_counts(run: RunFolder, steps: dict[str, int], images: int = 0, images_key: str = "") -> None:
    """Every count a command asks of a run, bounded before any work, in one line each: a step count by the teacher's
    training timesteps (its scheduler's `num_train_timesteps`: more steps only repeat timesteps), the images held at
    once (`images`, named by `images_key`) by this machine's memory (latents and decoded images, teacher's and
    student's)."""

    top = run.spec.num_train_timesteps
    for key, n in steps.items():
        if n > top:
            raise UserError(
                f"{key} {n} is more than this teacher's {top} training timesteps (its scheduler's "
                f"num_train_timesteps), so most steps would repeat; give {top} or fewer"
            )
    if images:
        check_images(run.latent_shape, run.spec.path, images, images_key)


def check_images(latent_shape, teacher_path: Path | None, images: int, images_key: str) -> None:
    """The images an evaluation holds at once (latents and decoded images, teacher's and student's) against this
    machine's memory, in one line naming `images_key`: for eval and generate, and a run's end-of-run evaluation."""
    channels, frames, height, width = latent_shape
    scale = image_scale(teacher_path)
    each = 2 * 4 * (channels * frames * height * width + 3 * frames * height * scale * width * scale)
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if images * each > total:
        fit = max(1, total // each)
        raise UserError(
            f"{images_key} asks for {images:,} images, which take {images * each / 2**30:,.1f} GiB "
            f"held at once, more than this machine's {total / 2**30:.0f} GiB; ask for at most "
            f"{fit:,} in all"
        )


def _vae_factor(teacher_path: Path | None, key: str, wan: int) -> int:
    """A factor of the teacher's VAE (`vae/config.json`'s `key`, as WanPipeline reads it); Wan's `wan` where the
    folder is not at hand or the value is not a sane factor."""
    if teacher_path is None:
        return wan
    try:
        factor = read_json_in(Path(teacher_path), "vae/config.json").get(key, wan)
    except (TypeError, OSError, ValueError, AttributeError, UserError):
        return wan
    return factor if isinstance(factor, int) and 0 < factor <= 64 else wan


def image_scale(teacher_path: Path | None) -> int:
    """Pixels per latent pixel: 8 for Wan, 4 for the pocket teachers."""
    return _vae_factor(teacher_path, "scale_factor_spatial", 8)


def time_scale(teacher_path: Path | None) -> int:
    """Frames per latent frame: 4 for Wan, 2 for the pocket video teacher."""
    return _vae_factor(teacher_path, "scale_factor_temporal", 4)


def load_teacher(run: RunFolder, device: torch.device, dtype: torch.dtype) -> Teacher:
    """The whole teacher on one device, with the run's guidance scales: what teacher_placement=cpu/gpu load."""

    return load_whole(run.spec, run.cfg.teacher, dtype, device)


def generate(
    sampler: Teacher,
    embeddings,
    prompt_idx: list[int],
    seed: int,
    steps: int,
    shape,
    what: str = "sampling",
    per_prompt: int = 1,
    scheduler=None,
    images=None,
) -> tuple:
    """(latents [N, C, F, H, W], seconds per image) from `noise_for(seed, i, k, stream="eval")` for each prompt i and
    each of its `per_prompt` images k (several noises per prompt: what FID and diversity need), prompt by prompt;
    with the teacher's scheduler, or `scheduler` (a few-step student's: `student_scheduler`).

    An image-to-video sampler needs `images`: `(vae, image_encoder, given)` where `given(i, k)` is the first frame
    (a PIL image) of prompt i's image k, sampled through the model's own WanImageToVideoPipeline (its VAE encodes
    the image each call, and its CLIP where `image_encoder` is `load_image_encoder`'s pair, not (None, None)).

    One image per pipeline call, so the seconds are per image; a 1-step call (a few-step student: its own steps)
    first pays the warm-up. A log line after the first image says what the rest will take (`what: 1/8 images in
    2.1 s, so about 15 s for the rest`), and one as each quarter is done: a long evaluation is not silent for minutes.
    """
    if images is None:
        pipe, given = teacher_pipeline(sampler, scheduler), lambda i, k: None
    else:
        vae, encoder, given = images
        pipe = image_pipeline(sampler.spec, sampler.experts, sampler.device, vae, scheduler, encoder)
    settings = SamplerSettings(steps, tuple(sampler.guidance_scales), tuple(shape))
    out, seconds = [], []
    items = [(i, k) for i in prompt_idx for k in range(per_prompt)]
    for n, (i, k) in enumerate(items):
        noise = noise_for(seed, i, k, tuple(shape), stream="eval")[None].to(sampler.device)
        cond = embeddings.padded(torch.tensor([i])).to(sampler.device, sampler.dtype)
        uncond = embeddings.negative_batch(1).contiguous().to(sampler.device, sampler.dtype)
        if n == 0:  # a few-step scheduler warms up at its own steps: set to 1 step, its stretched schedule is NaN
            warm = 1 if scheduler is None else steps
            warming = SamplerSettings(warm, settings.guidance_scales, settings.latent_shape)
            sample_latents(pipe, noise, cond, uncond, warming, given(i, k))
        start = time.perf_counter()
        out.append(sample_latents(pipe, noise, cond, uncond, settings, given(i, k)))
        if sampler.device.type == "cuda":
            torch.cuda.synchronize(sampler.device)
        seconds.append(time.perf_counter() - start)
        if n == 0 and len(items) > 1:  # what the rest costs, said as soon as it is measured: Ctrl-C is still cheap
            logging.getLogger("wandistiller").info(
                "%s: 1/%d images in %.3g s, so %s for the rest", what, len(items), seconds[0],
                _duration(seconds[0] * (len(items) - 1)),
            )  # fmt: skip
        elif (n + 1) % max(1, len(items) // 4) == 0 or n + 1 == len(items):
            logging.getLogger("wandistiller").info(
                "%s: %d/%d images, %.3g s each", what, n + 1, len(items), seconds[-1]
            )
    return torch.cat(out), seconds


def _duration(seconds: float) -> str:
    return (
        "under 1 s" if seconds < 1 else f"about {seconds:.0f} s" if seconds < 120 else f"about {seconds / 60:.0f} min"
    )
