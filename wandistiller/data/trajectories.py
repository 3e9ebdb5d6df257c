"""Points of the teacher's guided ODE at a few-step student's sigmas, cached on disk: what `method=trajectory`
learns to jump between (and `method=dmd`'s optional regression term).

From fixed noises (per training prompt, `per_prompt` each, drawn as teacher latents draw theirs, on a stream of
their own), diffusers' WanPipeline runs the teacher: its experts (routed at the boundary), its own scheduler class
and config, its guidance, `teacher_steps` steps. Only the sigmas those steps start from are chosen here, so that
the student's K + 1 (teacher/fewstep.py: `student_schedule`) are among them: the teacher's steps are split among
the student's K intervals in proportion to their lengths before the flow shift (at least one each), each interval
evenly, over the same [1, 1/T] the scheduler's default spans -- so for K = 1 they are its default schedule. The
latents after the step that lands on each student sigma are kept: an item is [K + 1, C, F, H, W], x(sigma_0) the
noise itself and x(sigma_K) the sample. The cache is data/latents.py's (`cached_bank`): keyed, chunked, resumable.

An image-to-video teacher's ODE runs in its own WanImageToVideoPipeline (teacher/sampler.py `image_pipeline`), each
prompt's noises from that prompt's image, given as the run's cached conditioning (data/conditions.py `ImageBank`):
the model's own loop, CFG and expert switch on exactly what the student is then fed. The cache is keyed on the
images too.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from wandistiller.core.errors import UserError
from wandistiller.data.latents import SamplerSettings, cache_key, cached_bank, load_latent_bank, noise_for
from wandistiller.data.prompts import PromptEmbeddings
from wandistiller.teacher.model import Teacher
from wandistiller.teacher.sampler import given_image, image_pipeline, wan_pipeline
from wandistiller.teacher.vae import vae_skeleton

log = logging.getLogger("wandistiller")

STREAM = "trajectories"  # the noises' own stream: not the teacher latents', evaluation's or generation's


@dataclass(frozen=True)
class TrajectorySettings:
    """What the teacher samples with (`sampler.steps`: its steps) and the student's K + 1 sigmas, ending at 0."""

    sampler: SamplerSettings
    sigmas: tuple[float, ...]

    @property
    def points(self) -> int:
        return len(self.sigmas)


def scheduler_shift(scheduler) -> float:
    """The flow shift a scheduler applies to the sigmas it is given (UniPC's `flow_shift`, FlowMatchEuler's `shift`)."""
    config = scheduler.config
    return float(config["flow_shift"] if "flow_shift" in config else config["shift"])


def ode_sigmas(student_sigmas, steps: int, shift: float, num_train_timesteps: int) -> tuple[np.ndarray, list[int]]:
    """(the `steps` unshifted sigmas the teacher's scheduler is given, the index in its shifted sigmas of each
    student sigma after the first): the student's intervals get steps in proportion to their unshifted lengths."""
    shifted = [float(s) for s in student_sigmas[:-1]]
    if not 1 <= len(shifted) <= steps:
        raise ValueError(f"{len(shifted)} student steps cannot land on {steps} teacher steps")
    u = [s / (shift - (shift - 1) * s) for s in shifted] + [1 / num_train_timesteps]  # the shift undone
    lengths = np.array([a - b for a, b in zip(u, u[1:])])
    share = lengths / lengths.sum() * steps
    counts = np.maximum(1, np.floor(share)).astype(int)
    while counts.sum() > steps:  # the minimum of one each took more: from the longest over-served interval
        counts[np.argmax(np.where(counts > 1, counts - share, -np.inf))] -= 1
    while counts.sum() < steps:  # the rest to the largest remainders
        counts[np.argmax(share - counts)] += 1
    sigmas = np.concatenate([np.linspace(a, b, n + 1)[:-1] for a, b, n in zip(u, u[1:], counts)])
    return sigmas, [int(i) for i in np.cumsum(counts)]


def with_sigmas(pipe, sigmas: np.ndarray):
    """The pipeline's scheduler set to `sigmas` whatever step count WanPipeline asks it for (its own class and
    config: only where its steps start is chosen)."""
    scheduler = pipe.scheduler
    own = scheduler.set_timesteps
    scheduler.set_timesteps = lambda num_inference_steps=None, device=None, **kw: own(device=device, sigmas=sigmas)
    return pipe


def sample_trajectories(
    pipe, noise, cond, uncond, settings: TrajectorySettings, num_train_timesteps: int, condition=None
):
    """One WanPipeline call from `noise`: [n, K + 1, C, F, H, W], float32 on the CPU (x at each student sigma). An
    image pipeline's call takes `condition`, one image's ImageCondition, for all n."""
    s = settings.sampler
    sigmas, landed = ode_sigmas(settings.sigmas, s.steps, scheduler_shift(pipe.scheduler), num_train_timesteps)
    with_sigmas(pipe, sigmas)
    points = [noise.float().cpu()]
    after = {i - 1 for i in landed}

    def keep(pipeline, i, t, tensors):
        if i in after:
            points.append(tensors["latents"].float().cpu())
        return {}

    _, frames, height, width = s.latent_shape
    side = pipe.vae_scale_factor_spatial
    pipe(
        **given_image(pipe, height * side, width * side, None, condition),
        prompt_embeds=cond,
        negative_prompt_embeds=uncond,
        latents=noise,
        guidance_scale=s.guidance_scales[0],
        guidance_scale_2=s.guidance_scales[1] if len(s.guidance_scales) == 2 else None,
        num_inference_steps=s.steps,
        height=height * side,
        width=width * side,
        num_frames=(frames - 1) * pipe.vae_scale_factor_temporal + 1,
        output_type="latent",
        callback_on_step_end=keep,
    )
    reached = pipe.scheduler.sigmas[[0, *landed]].double().tolist()
    wanted = list(settings.sigmas)
    if len(points) != settings.points or not all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(reached, wanted)):
        raise RuntimeError(f"the teacher's {type(pipe.scheduler).__name__} landed on sigmas {reached}, not {wanted}")
    return torch.stack(points, dim=1)


def trajectories_folder(
    spec,
    embeddings: PromptEmbeddings,
    seed: int,
    settings: TrajectorySettings,
    dtype,
    cache_dir,
    items: int | None = None,
    images=None,
):
    """Where these ODE points are cached: what a rank without a teacher passes to `load_latent_bank`. A bank of the
    first `items` only (a short run's: `bank_items`) has its own folder: a whole one is never read as it, nor it as
    whole. Points sampled from `images` (an ImageBank) are keyed on them too."""
    key = cache_key(spec, embeddings, seed, settings.sampler, dtype)
    if images is not None:
        key = hashlib.sha256(f"{key}|{images.identity()}".encode()).hexdigest()[:20]
    sigmas = hashlib.sha256(repr([round(s, 6) for s in settings.sigmas]).encode()).hexdigest()[:8]
    part = "" if items is None or items >= all_items(embeddings, settings) else f"-first{items}"
    return Path(cache_dir).expanduser() / "trajectories" / f"{key}-{sigmas}{part}"


def all_items(embeddings: PromptEmbeddings, settings: TrajectorySettings) -> int:
    """Every training prompt's noises: the whole bank."""
    return len(embeddings.prompts) * settings.sampler.latents_per_prompt


def bank_items(embeddings: PromptEmbeddings, settings: TrajectorySettings, draws: int) -> int:
    """The trajectories a run can use: all of them, or (a run drawing fewer: `draws` = its steps x samples per step)
    the first `draws`, whole prompts (all of a prompt's noises): a quick try does not pay for every caption."""
    per = settings.sampler.latents_per_prompt
    return min(all_items(embeddings, settings), -(-max(1, draws) // per) * per)


def teacher_trajectories(
    teacher: Teacher,
    embeddings: PromptEmbeddings,
    seed: int,
    settings: TrajectorySettings,
    cache_dir: str | os.PathLike,
    chunk_size: int = 16,
    progress: bool = True,
    items: int | None = None,
    images=None,
):
    """A LatentBank whose item j (prompt j // per_prompt) is the ODE's K + 1 points from noise j, made once and
    cached (the first `items` of them: `bank_items`); with `images` (an image-to-video teacher's ImageBank), from
    prompt j // per_prompt's image. Only the process holding the teacher calls this; the others then call
    `load_trajectories(...)`."""
    s = settings.sampler
    folder = trajectories_folder(teacher.spec, embeddings, seed, settings, teacher.dtype, cache_dir, items, images)
    pipe: list = []  # built on the first chunk that needs it: a complete cache loads no pipeline
    timed: list = []

    def make_chunk(items: range) -> torch.Tensor:
        if not pipe:  # the image pipeline is given the cached conditioning: no VAE weights or CLIP are read for it
            if images is None:
                pipe.append(wan_pipeline(teacher.spec, teacher.experts, teacher.device))
            else:
                pipe.append(image_pipeline(teacher.spec, teacher.experts, teacher.device, vae_skeleton(teacher.spec)))
        prompts = torch.tensor([j // s.latents_per_prompt for j in items])
        noise = torch.stack(
            [
                noise_for(seed, j // s.latents_per_prompt, j % s.latents_per_prompt, s.latent_shape, STREAM)
                for j in items
            ]
        )
        cond = embeddings.padded(prompts).to(teacher.device, teacher.dtype)
        uncond = embeddings.negative_batch(len(items)).contiguous().to(teacher.device, teacher.dtype)
        steps = teacher.spec.num_train_timesteps
        start = time.perf_counter()
        # With images, a call per prompt: the pipeline gives one image's CLIP tokens to its whole batch.
        calls = [slice(None)] if images is None else runs(prompts)
        given = lambda rows: None if images is None else images.select(prompts[rows][:1]).to(teacher.device)
        parts = [
            sample_trajectories(pipe[0], noise[r].to(teacher.device), cond[r], uncond[r], settings, steps, given(r))
            for r in calls
        ]
        made = parts[0] if len(parts) == 1 else torch.cat(parts)  # one call (text to video): not copied
        if not timed:  # roughly how long, said once the first chunk shows this machine's pace
            timed.append(len(items))
            left = (total - items.stop) / len(items) * (time.perf_counter() - start)
            if left > 0:
                log.info("teacher ODE points: about %.0f s more at this chunk's pace", left)
        return made

    total = all_items(embeddings, settings) if items is None else min(items, all_items(embeddings, settings))
    shape = (settings.points, *s.latent_shape)
    check_cache_size(folder, total, shape)  # before the teacher samples anything
    return cached_bank(
        folder, total, chunk_size, s.latents_per_prompt, make_chunk, "teacher ODE points", progress, shape
    )


def check_cache_size(folder: Path, items: int, item_shape: tuple[int, ...]) -> None:
    """The trajectory cache (`items` float32 items of `item_shape`) fits on its disk, with what of it is already
    there: one line naming the keys that size it, before any work -- not a full disk hours in."""

    need = items * math.prod(item_shape) * 4
    have = sum(f.stat().st_size for f in folder.glob("*.pt")) if folder.is_dir() else 0
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need - have > free:
        raise UserError(
            f"the teacher's ODE points take {need / 2**30:,.1f} GiB ({items:,} items of {list(item_shape)}: the "
            f"training prompts x method.noises_per_prompt), and {probe} has {free / 2**30:,.1f} GiB free; lower "
            "method.noises_per_prompt or the prompts, or set paths.cache_dir=… to a larger disk"
        )


def runs(prompts: torch.Tensor) -> list[slice]:
    """The rows of each run of one prompt in `prompts` (a chunk's, in order)."""
    ends = torch.unique_consecutive(prompts, return_counts=True)[1].cumsum(0).tolist()
    return [slice(a, b) for a, b in zip([0, *ends], ends)]


def load_trajectories(
    spec, embeddings, seed: int, settings: TrajectorySettings, dtype, cache_dir, items=None, images=None
):
    """The cached bank another rank made (None if it is not whole)."""
    folder = trajectories_folder(spec, embeddings, seed, settings, dtype, cache_dir, items, images)
    return load_latent_bank(folder, (settings.points, *settings.sampler.latent_shape))
