"""The teacher-vs-student sample grids: every drawing, in one place (the samples hook decides when they are drawn).

The images come from diffusers' own WanPipeline (teacher/sampler.py). The student is a WanTransformer3DModel, so it
drops into WanPipeline as `transformer`; it was trained on guided targets, so it samples without CFG
(guidance_scale=1). A run's teacher column is drawn once, before training (`sample_grids`); each grid then draws
the student from the same noise and prompts (`SampleGrid(student, path)`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from wandistiller.core.files import run_folder
from wandistiller.data.conditions import ImageBank
from wandistiller.data.prompts import PromptEmbeddings
from wandistiller.evaluation.grids import save_clip_grid, save_grid
from wandistiller.recipe.context import RunContext
from wandistiller.teacher.fewstep import few_step_scheduler
from wandistiller.teacher.lora import sampling_transformers
from wandistiller.teacher.model import Teacher
from wandistiller.teacher.sampler import given_image, image_pipeline, wan_pipeline
from wandistiller.teacher.spec import TeacherSpec
from wandistiller.teacher.vae import load_vae

log = logging.getLogger("wandistiller")


@dataclass(frozen=True)
class SampleGrid:
    """One run's grid: the teacher's column, drawn once, and the prompts it shows. Called with the student and a
    path, it draws the student from the same noise and prompts now and saves the grid there."""

    ctx: RunContext
    teacher_column: np.ndarray | None  # None on the ranks that never draw a grid; [N, F, H, W, 3] clips
    embeddings: PromptEmbeddings
    prompts: int
    steps: int
    images: ImageBank | None = None  # an image-to-video teacher's: prompt i's given first frame is row i's

    def __call__(self, student: torch.nn.Module, path: Path) -> Path:
        ctx, n = self.ctx, self.prompts
        # A few-step student is drawn as it will be sampled: at its K, on the sigmas it is trained at.
        steps = ctx.student_steps or self.steps
        scheduler = few_step_scheduler(ctx.spec, steps, ctx.student_schedule) if ctx.student_steps else None
        was_training = student.training
        assert self.teacher_column is not None  # drawn on the main rank, the one whose hook calls this
        student.eval()
        with sampling_transformers(student) as (transformers, guidance):
            mine = draw(
                ctx.spec,
                transformers,
                guidance,
                self.embeddings,
                ctx.data_cfg,
                n,
                steps,
                ctx.seed,
                None,
                scheduler,
                self.images,
            )
        student.train(was_training)
        run_folder(self.ctx.run_dir, path.parent)  # samples/ as the run goes: inside the run folder, never a link out
        prompts = self.embeddings.prompts[:n]
        if self.clips:  # the still strip at `path`, the animated teacher | student GIF beside it
            return save_clip_grid(self.teacher_column, mine, prompts, path, root=self.ctx.run_dir)[0]
        return save_grid(self.teacher_column, mine, prompts, path, root=self.ctx.run_dir)

    @property
    def clips(self) -> bool:
        """A clip run's grid (data.latent_frames > 1): a still strip PNG and a GIF beside it (`<stem>.gif`)."""
        return self.ctx.data_cfg.latent_frames > 1


def sample_grids(
    ctx: RunContext, teacher, embeddings: PromptEmbeddings, n: int, steps: int, images: ImageBank | None = None
) -> SampleGrid | None:
    """The run's grid of `n` prompts in `steps` sampling steps, its teacher column drawn now: by rank 0 (which always
    holds a teacher; a sharded one needs every rank in its forwards, so every rank calls this), then sent to the
    main rank. An image-to-video run's clips start from each prompt's own image (`images`). None without samples."""
    if n <= 0:
        return None
    if ctx.is_main:  # a real teacher takes minutes here, before step 1: say what the wait is
        log.info(
            "samples: the teacher draws %d image(s) in %d steps for the sample grids (hooks.samples.prompts=0 "
            "skips them)",
            n,
            steps,
        )
    draws = ctx.makes_teacher_data
    drawn = [teacher_images(teacher, embeddings, ctx.data_cfg, n, steps, ctx.seed, images) if draws else None]
    if ctx.topo.distributed:
        dist.broadcast_object_list(drawn, src=0)
    return SampleGrid(ctx, drawn[0], embeddings, n, steps, images)


@torch.no_grad()
def draw(
    spec: TeacherSpec,
    transformers: list,
    guidance_scales: list,
    embeddings: PromptEmbeddings,
    data_cfg,
    num_prompts: int,
    steps: int,
    seed: int,
    device: torch.device | None = None,
    scheduler=None,
    images: ImageBank | None = None,
) -> np.ndarray:
    """First frames [N, H, W, 3] for the first `num_prompts` prompts (of a clip run, data.latent_frames > 1, whole
    clips [N, F, H, W, 3]): teacher (its experts and CFG, on the device it takes its inputs on) or student (no CFG,
    where its weights are; a few-step student with its own `scheduler`, teacher/fewstep.py). An image-to-video
    teacher's (`images`: prompt i's conditioning, row i) through its own WanImageToVideoPipeline, a prompt a call
    (the pipeline repeats one image's CLIP tokens over a batch), noise from `seed + i`."""

    idx = torch.arange(min(num_prompts, len(embeddings.prompts)))
    cond, uncond = embeddings.padded(idx), embeddings.negative_batch(len(idx)).contiguous()
    transformer = transformers[0]
    device, dtype = device or transformer.device, transformer.dtype
    vae = load_vae(spec, device)
    two = len(transformers) == 2
    # The teacher's own scheduler, as the teacher latents, eval and generate use (teacher/sampler.py), or the
    # few-step student's.
    height = data_cfg.latent_height * vae.config.scale_factor_spatial
    width = data_cfg.latent_width * vae.config.scale_factor_spatial
    common = dict(
        guidance_scale=guidance_scales[0],
        guidance_scale_2=guidance_scales[1] if two else None,
        num_inference_steps=steps,
        output_type="np",
        height=height,
        width=width,
        num_frames=(data_cfg.latent_frames - 1) * vae.config.scale_factor_temporal + 1,
    )
    cond, uncond = cond.to(device, dtype), uncond.to(device, dtype)
    if images is None:
        pipe = wan_pipeline(spec, transformers, device, vae=vae, scheduler=scheduler)
        generator = torch.Generator(device).manual_seed(seed)
        frames = pipe(prompt_embeds=cond, negative_prompt_embeds=uncond, generator=generator, **common).frames
    else:
        pipe = image_pipeline(spec, transformers, device, vae, scheduler)
        rows = []
        for i in range(len(idx)):
            given = given_image(pipe, height, width, condition=images.select(idx[i : i + 1]))
            generator = torch.Generator(device).manual_seed(seed + i)
            one = dict(prompt_embeds=cond[i : i + 1], negative_prompt_embeds=uncond[i : i + 1], generator=generator)
            rows.append(pipe(**given, **one, **common).frames)
        frames = np.concatenate(rows)
    return frames if data_cfg.latent_frames > 1 else frames[:, 0]


def teacher_images(
    teacher: Teacher,
    embeddings: PromptEmbeddings,
    data_cfg,
    num_prompts: int,
    steps: int,
    seed: int,
    images: ImageBank | None = None,
) -> np.ndarray:
    return draw(
        teacher.spec,
        teacher.experts,
        teacher.guidance_scales,
        embeddings,
        data_cfg,
        num_prompts,
        steps,
        seed,
        teacher.device,
        images=images,
    )
