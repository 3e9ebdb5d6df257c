"""What every few-step method shares (`method=trajectory`, `method=dmd`): the schema keys of the student's K, its
schedule and the teacher's cached ODE (`FewStepConfig`), and those cached ODE points with their jump loss
(`OdePoints`: trajectory's training data, dmd's regression term). Not an option: it declares no `OPTION`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import MISSING

from wandistiller.core.distributed import made_once
from wandistiller.core.errors import UserError
from wandistiller.data.batches import mixed_seed
from wandistiller.data.latents import SamplerSettings
from wandistiller.data.trajectories import (
    TrajectorySettings,
    all_items,
    bank_items,
    load_trajectories,
    teacher_trajectories,
)
from wandistiller.teacher.fewstep import DEFAULT_SCHEDULE, Schedule, student_schedule
from wandistiller.teacher.image import denoised_frames
from wandistiller.teacher.model import guidance_scales

STREAM = 1  # the draws' own generator stream beside the data's (seed, step, micro, rank)


log = logging.getLogger("wandistiller")


@dataclass
class FewStepConfig:
    """The keys every few-step method's schema shares (trajectory, dmd): the student's K, the teacher's sample
    steps, and the teacher's cached ODE (`OdePoints`: trajectory's training data, dmd's regression term)."""

    _target_: str = MISSING  # each method's own (its schema sets it)
    name: str = MISSING
    # K: the student's steps (its schedule: teacher/fewstep.py), at most the teacher's `teacher_steps`.
    steps: int = 4
    # The teacher's sample steps (K may not exceed them): its ODE's (its own scheduler and guidance), split among
    # the student's K intervals.
    teacher_steps: int = 20
    # The K sigmas the student is trained at, and sampled at everywhere it is exported (sampling.json, the pipeline's
    # scheduler, the ComfyUI workflow): "euler" (diffusers' flow-match Euler at K: what a saved pipeline samples with
    # num_inference_steps=K and no code), "simple" / "beta" (ComfyUI's schedulers of those names at `shift`), or a
    # list of K sigmas in (0, 1], decreasing (the final 0 left out). Default euler: docs/USAGE.md says why.
    schedule: Any = DEFAULT_SCHEDULE
    # The flow shift of schedule=simple or beta (ComfyUI's ModelSamplingSD3 shift); null: the teacher's.
    shift: float | None = None
    # Fixed noises per training prompt, each one trajectory of the cached ODE.
    noises_per_prompt: int = 2
    # Trajectories per cache chunk: an interrupted run keeps its finished chunks.
    chunk: int = 16


def schedule_identity(schedule: Schedule) -> dict:
    """What a checkpoint records of the method's schedule (a resume at other sigmas is refused): nothing for the
    default, so a checkpoint from before `method.schedule` resumes as it did."""
    return {} if schedule == Schedule() else {"schedule": schedule.describe()}


def positive(key: str, value: int) -> int:
    if value < 1:
        raise UserError(f"{key}={value} must be a positive integer")
    return value


class OdePoints:
    """The cached ODE points of a run and the student's schedule: batches of jumps and their loss."""

    def __init__(
        self,
        ctx,
        teacher,
        embeddings,
        steps: int,
        teacher_steps: int,
        per_prompt: int,
        chunk: int,
        schedule: Schedule | None = None,
        skip: str = "",
        images=None,
    ):

        self.timesteps, self.sigmas = student_schedule(ctx.spec, steps, schedule)
        sampler = SamplerSettings(
            teacher_steps, tuple(guidance_scales(ctx.spec, ctx.teacher_cfg)), ctx.latent_shape, per_prompt
        )
        settings = TrajectorySettings(sampler, tuple(self.sigmas.double().tolist()))
        dtype = ctx.precision.teacher_dtype
        t = ctx.trainer_cfg
        # The most trajectories the run can draw (each micro-batch draws batch_size, on every rank): no more are made.
        items = bank_items(embeddings, settings, t.max_steps * t.grad_accum_steps * t.batch_size * ctx.topo.world_size)
        whole = all_items(embeddings, settings)
        if ctx.topo.rank == 0:  # the cost said before it is paid, and how not to pay it
            log.info(
                "teacher ODE points: %d trajectories (%d prompt(s) x %d noise(s)%s) of %d teacher steps with CFG, "
                "made once and cached (an estimate follows the first chunk)%s",
                items,
                items // per_prompt,
                per_prompt,
                f"; of {whole}: what trainer.max_steps={t.max_steps} can draw" if items < whole else "",
                teacher_steps,
                f"; {skip}" if skip else "",
            )
        made = lambda: teacher_trajectories(
            teacher, embeddings, ctx.seed, settings, ctx.cache_dir, chunk, ctx.topo.rank == 0, items, images
        )
        self.bank = made_once(
            ctx.topo,
            made,
            lambda: load_trajectories(ctx.spec, embeddings, ctx.seed, settings, dtype, ctx.cache_dir, items, images),
            makes=ctx.makes_teacher_data,
        )
        self.embeddings, self.seed, self.batch_size = embeddings, ctx.seed, ctx.trainer_cfg.batch_size
        self.images = images  # an image-to-video teacher's, per prompt: its ODE ran from them, the student takes them

    def loss(self, run, step: int, micro: int) -> torch.Tensor:
        """MSE of the student's velocity against the jump's, on `batch_size` drawn trajectories and jumps (over the
        frames it denoises: not TI2V's given first one)."""
        g = torch.Generator().manual_seed(mixed_seed(self.seed, step, micro, run.dp_rank, STREAM))
        n, k = self.batch_size, len(self.timesteps)
        items = torch.randint(len(self.bank), (n,), generator=g)
        jump = torch.randint(k, (n,), generator=g)
        points = self.bank.x0(items)  # [n, K + 1, C, F, H, W]
        rows = torch.arange(n)
        x, after = points[rows, jump], points[rows, jump + 1]
        gap = (self.sigmas[jump + 1] - self.sigmas[jump]).view(-1, 1, 1, 1, 1)
        target = ((after - x) / gap).to(run.device)
        prompts = self.bank.prompt_idx[items]
        cond = self.embeddings.padded(prompts, run.device)
        image = None if self.images is None else self.images.select(prompts).to(run.device)
        dtype = run.precision.autocast_dtype
        with torch.autocast(run.device.type, dtype=dtype, enabled=dtype is not None):
            pred, _ = run.model(x.to(run.device), self.timesteps[jump].to(run.device), cond, image)
        return F.mse_loss(denoised_frames(image, pred.float()), denoised_frames(image, target))
