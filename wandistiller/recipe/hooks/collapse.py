"""`hooks.collapse` (in the default `hooks` list): a watch for the collapse few-step students are known for
(static, solid-colour or black samples, every noise drawn to one image). Every `hooks.collapse.every` steps the
student samples a small fixed probe set -- `prompts` of the run's held-out prompts x `noises` noises each, chosen
once from the run's seed -- at its own K steps, and its figures are logged beside the teacher's, whose reference
is drawn once, at the first check, from the same noises (the teacher's scheduler, CFG and `teacher_steps`):

    collapse/diversity_ratio    the student's intra-prompt diversity / the teacher's (eval's measure: the pocket
                                judge's features on pocket prompts; on other prompts, the decoded pixels)
    collapse/saturation         share of pixel values clipped (0 or 255 once decoded); collapse/teacher_saturation
    collapse/flat               share of near-constant images (solid colour, black); collapse/teacher_flat

(with `collapse/diversity`, `collapse/teacher_diversity` and `collapse/collapsed`, 1 while it looks collapsed), into
the loggers and `metrics_steps.jsonl`. A clip run (`data.latent_frames > 1`) is judged on its clips' first frames, and
its motion is watched too (the motion guard):

    collapse/motion_ratio       the student's motion / the teacher's on the probe set, from the same noises: on pocket
                                video prompts the digit's speed along its fitted track (px per frame, eval's), on
                                other prompts the mean absolute change of the pixels from frame to frame
    collapse/motion             the student's motion; collapse/teacher_motion the teacher's; collapse/still 1 while the
                                ratio is under `min_motion`

A motion ratio under `min_motion` (0.7 unless set; 0 never warns) is said in its own warning line, once per episode,
naming what to try: few-step students are known to lose their motion before their frames look wrong.

A diversity ratio under `min_diversity`, or a saturation or flat share more than `max_saturation_rise` above the
teacher's, is said in one warning line, once per episode (again only after a check that looked healthy), with the
step, the figures and what to try. A KD student, which samples at the
teacher's steps, is watched only when `hooks.collapse.steps` asks for it.

An image-to-video run's probe is drawn from its held-out images (each prompt's own, cached as the data encoded them)
through the model's own WanImageToVideoPipeline.

It runs on the main training rank (the student's samples, the logging); where the teacher's forwards are
collectives (sharded) every rank draws the teacher's reference together. Where the teacher lives in another
process (gpu0's dedicated owner) the student's figures are logged without the teacher's, and nothing is judged.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option
from wandistiller.data.latents import SamplerSettings, noise_for, sample_latents
from wandistiller.data.prompts import encode_prompts, read_prompts
from wandistiller.data.validation import split_prompts
from wandistiller.evaluation.clips import is_video_pocket
from wandistiller.evaluation.collapse import checked_share, collapse_signs, compared, figures, motion_sign, summary
from wandistiller.pocket import FRAME_CLASSIFIER_FILE
from wandistiller.pocket.classifier import load_classifier
from wandistiller.pocket.digits import parse_prompt
from wandistiller.recipe.hooks.base import Hook, at_least
from wandistiller.recipe.hooks.monitor import append_rows
from wandistiller.state.checkpoint import checkpoint_step, list_checkpoints
from wandistiller.teacher.fewstep import few_step_scheduler
from wandistiller.teacher.image import ImageCondition
from wandistiller.teacher.lora import sampling_transformers
from wandistiller.teacher.sampler import image_pipeline, wan_pipeline
from wandistiller.teacher.vae import decode_clips, decode_latents, load_vae

if TYPE_CHECKING:
    from wandistiller.data.conditions import ImageBank
    from wandistiller.data.prompts import PromptEmbeddings
    from wandistiller.pocket.classifier import DigitJudge

log = logging.getLogger("wandistiller")

# Images decoded together: as many as the sample grids' default 4 prompts, which WanPipeline decodes as one batch.
DECODE_BATCH = 4


@dataclass
class CollapseConfig:
    _target_: str = "wandistiller.recipe.hooks.collapse.CollapseWatch"
    # A check every N steps; 0 = off.
    every: int = 100
    # The probe set: this many of the run's held-out prompts (0 = off), each from this many fixed noises (2 or more:
    # diversity is measured among one prompt's images).
    prompts: int = 4
    noises: int = 2
    # The student's sampling steps: None = its own K (method.steps); a KD student is watched only when this is set.
    steps: int | None = None
    # The teacher's reference (its scheduler and CFG), drawn once at the first check.
    teacher_steps: int = 20
    # The warning: a diversity ratio under this, or a saturation or flat share this far above the teacher's.
    min_diversity: float = 0.5
    max_saturation_rise: float = 0.2
    # The motion guard (clips only): a student/teacher motion ratio under this warns (0 = never).
    min_motion: float = 0.7


@dataclass(frozen=True)
class Probe:
    """The fixed probe set: prompt indices into `embeddings`, each drawn from `noises` noises of its own."""

    embeddings: PromptEmbeddings
    indices: tuple[int, ...]
    noises: int
    seed: int
    latent_shape: tuple[int, int, int, int]
    images: ImageBank | None = None  # an image-to-video teacher's: prompt i's given image is row i's

    def condition(self, i: int) -> ImageCondition | None:
        """Prompt i's image conditioning (one image, its noises share it); None for a text-to-video teacher."""
        return None if self.images is None else self.images.select(torch.tensor([i]))

    @property
    def prompts(self) -> list[str]:
        """One prompt per image, in the order the images are drawn."""
        return [self.embeddings.prompts[i] for i in self.indices for _ in range(self.noises)]

    def noise(self, i: int) -> torch.Tensor:
        """The `noises` starting noises of prompt i: their own stream of the run's seed, the same at every check."""

        return torch.stack(
            [noise_for(self.seed, i, k, self.latent_shape, stream="collapse") for k in range(self.noises)]
        )


def choose_probe(ctx, prompts: int, noises: int, held_out_images: tuple | None = None) -> Probe:
    """`prompts` of the run's held-out prompts (the data's own split, as validation and eval take them), chosen from
    the run's seed; their embeddings are the ones the run encoded as it set up (read back from the cache). An
    image-to-video run's come with their images: `held_out_images`, the data's held-out (embeddings, ImageBank)."""

    if held_out_images is not None:
        embeddings, images = held_out_images
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(ctx.seed))
        chosen = tuple(sorted(int(i) for i in order[:prompts]))
        return Probe(embeddings, chosen, noises, ctx.seed, ctx.latent_shape, images)
    data, teacher = ctx.data_cfg, ctx.teacher_cfg
    _, held_out = split_prompts(read_prompts(data.prompts_path), data.val_prompts_path, data.val_fraction)
    embeddings = encode_prompts(
        ctx.spec,
        held_out,
        teacher.negative_prompt,
        teacher.max_sequence_length,
        ctx.precision.teacher_dtype,
        torch.device("cpu"),
        ctx.cache_dir,
    )
    order = torch.randperm(len(held_out), generator=torch.Generator().manual_seed(ctx.seed))
    chosen = tuple(sorted(int(i) for i in order[:prompts]))
    return Probe(embeddings, chosen, noises, ctx.seed, ctx.latent_shape)


@torch.no_grad()
def probe_latents(
    spec, transformers: list, guidance_scales: list, probe: Probe, steps: int, device: torch.device, scheduler=None
) -> torch.Tensor:
    """The probe set drawn through WanPipeline (as eval and the sample grids draw): a teacher's experts with its
    CFG and scheduler, or a student alone with guidance 1 and its few-step `scheduler`; an image-to-video teacher's
    through its WanImageToVideoPipeline, on each prompt's cached image. Clean latents, on the CPU."""

    if probe.images is None:
        pipe = wan_pipeline(spec, transformers, device, scheduler=scheduler)
    else:
        pipe = image_pipeline(spec, transformers, device, load_vae(spec, device), scheduler)
    settings = SamplerSettings(steps, tuple(guidance_scales), probe.latent_shape)
    dtype = transformers[0].dtype
    rows = []
    for i in probe.indices:  # one call per prompt, its noises as the batch
        cond = probe.embeddings.padded(torch.tensor([i] * probe.noises))
        uncond = probe.embeddings.negative_batch(probe.noises).contiguous()
        noise, text = probe.noise(i).to(device), cond.to(device, dtype)
        rows.append(sample_latents(pipe, noise, text, uncond.to(device, dtype), settings, condition=probe.condition(i)))
    return torch.cat(rows)


def decoded(spec, latents: torch.Tensor, device: torch.device) -> torch.Tensor:
    """First frames [N, 3, H, W] in [0, 1], DECODE_BATCH at a time (a real frame's decode is the memory peak); for
    latents of more than one frame, whole clips [N, F, 3, H, W]."""

    vae = load_vae(spec, device)
    decode = decode_clips if latents.shape[2] > 1 else decode_latents
    return torch.cat([decode(vae, part) for part in latents.split(DECODE_BATCH)])


class CollapseWatch(Hook):
    """`hooks.collapse`: the student's probe figures against the teacher's every `every` steps, and one warning line
    when they look collapsed (the module's docstring)."""

    main_only = False  # a sharded teacher draws its reference with every rank; the other ranks do nothing else

    def __init__(
        self,
        every: int = CollapseConfig.every,
        prompts: int = CollapseConfig.prompts,
        noises: int = CollapseConfig.noises,
        steps: int | None = CollapseConfig.steps,
        teacher_steps: int = CollapseConfig.teacher_steps,
        min_diversity: float = CollapseConfig.min_diversity,
        max_saturation_rise: float = CollapseConfig.max_saturation_rise,
        min_motion: float = CollapseConfig.min_motion,
    ):
        self.every = at_least("hooks.collapse.every", every, 0)
        self.prompts = at_least("hooks.collapse.prompts", prompts, 0)
        self.noises = at_least("hooks.collapse.noises", noises, 2)
        self.steps = None if steps is None else at_least("hooks.collapse.steps", steps, 1)
        self.teacher_steps = at_least("hooks.collapse.teacher_steps", teacher_steps, 1)
        if not (math.isfinite(min_diversity) and min_diversity >= 0):
            raise UserError(f"hooks.collapse.min_diversity={min_diversity} must be 0 or more (0 never warns on it)")
        self.min_diversity = min_diversity
        self.max_saturation_rise = checked_share("hooks.collapse.max_saturation_rise", max_saturation_rise)
        if not (math.isfinite(min_motion) and min_motion >= 0):
            raise UserError(f"hooks.collapse.min_motion={min_motion} must be 0 or more (0 never warns on it)")
        self.min_motion = min_motion
        self.still = False  # inside a motion episode: warned, not yet moving again
        self.probe: Probe | None = None  # None: this rank checks nothing
        self.draws_teacher = False  # this rank draws the teacher's reference (the main one, or all of a collective)
        self.reference: dict | None = None  # the teacher's figures, from the first check
        self.referenced = False  # the first check has run (the reference drawn, or found out of reach)
        self.collapsed = False  # inside an episode: warned, not yet healthy again
        self.last_healthy: int | None = None
        self.judge: DigitJudge | None = None  # eval's diversity features, where the probe's prompts are pocket's

    def bind(self, ctx, parts) -> None:
        self.ctx = ctx
        top = ctx.spec.num_train_timesteps  # more steps only repeat timesteps (and the teacher's draw has no end)
        for key, n in (("hooks.collapse.teacher_steps", self.teacher_steps), ("hooks.collapse.steps", self.steps)):
            if n is not None and n > top:
                raise UserError(
                    f"{key}={n} is more than this teacher's {top} training timesteps (its scheduler's "
                    f"num_train_timesteps); give {top} or fewer"
                )
        # A KD student samples at the teacher's steps: watched only when hooks.collapse.steps asks.
        self.student_steps = self.steps if self.steps is not None else ctx.student_steps
        if self.every <= 0 or self.prompts <= 0 or self.student_steps is None:
            return
        if ctx.student_steps is not None:
            self.student_scheduler(ctx)  # K explicit sigmas sample at K steps only: said now, not at the first check
        self.draws_teacher = ctx.roles.has_teacher and (ctx.is_main or ctx.placement.collective)
        if not (ctx.is_main or self.draws_teacher):
            return
        self.probe = choose_probe(ctx, self.prompts, self.noises, parts.held_out_images)
        if not ctx.is_main:
            return

        if all(parse_prompt(p) is not None for p in self.probe.prompts):  # eval's diversity: the judge's features
            self.judge = load_classifier()
        elif is_video_pocket(self.probe.prompts) and FRAME_CLASSIFIER_FILE.is_file():  # the video teacher's frames
            self.judge = load_classifier(FRAME_CLASSIFIER_FILE)
        against = (
            f"against the teacher's ({self.teacher_steps} steps, drawn at the first check)"
            if ctx.roles.has_teacher
            else f"without the teacher's: teacher_placement={ctx.placement.name} holds it in another process, so "
            "nothing is judged"
        )
        log.info(
            "hooks.collapse: every %d steps the student samples %d held-out prompt(s) x %d noises in %d steps, %s",
            self.every,
            len(self.probe.indices),
            self.noises,
            self.student_steps,
            against,
        )
        if ctx.trainer_cfg.max_steps < self.every:
            log.info(
                "hooks.collapse: trainer.max_steps=%d < hooks.collapse.every=%d: no check will run",
                ctx.trainer_cfg.max_steps,
                self.every,
            )

    def __call__(self, run, step: int) -> None:
        if self.probe is None or step % self.every:
            return
        with torch.random.fork_rng(devices=[self.ctx.device] if self.ctx.device.type == "cuda" else []):
            if not self.referenced:
                self.reference = self.teacher_reference(run)
                self.referenced = True
            if not self.ctx.is_main:
                return
            student = self.student_figures(run)
        self.judged(run, step, student)

    def judged(self, run, step: int, student: dict) -> dict:
        """The student's figures against the teacher's reference: logged, and a warning line at the first check of
        an episode that looks collapsed, or (clips) that lost its motion. Returns what was logged."""
        metrics = compared(student, self.reference)
        signs = collapse_signs(metrics, self.min_diversity, self.max_saturation_rise)
        metrics["collapse/collapsed"] = float(bool(signs))
        still = motion_sign(metrics, self.min_motion)
        if "collapse/motion_ratio" in metrics:
            metrics["collapse/still"] = float(still is not None)
        run.tracker.log(metrics, step=step)

        append_rows(Path(run.run_dir), [{"step": step} | metrics])
        log.info("step %d: hooks.collapse: %s", step, summary(metrics))
        if not signs:
            self.collapsed, self.last_healthy = False, step
        elif not self.collapsed:
            self.collapsed = True
            log.warning(
                "step %d: the student's samples look collapsed (hooks.collapse): %s; %s",
                step,
                ", ".join(signs),
                self.advice(run),
            )
        if still is None:
            self.still = False
        elif not self.still:
            self.still = True
            log.warning(
                "step %d: the student's clips lose their motion (hooks.collapse): %s; %s",
                step,
                still,
                self.motion_advice(run),
            )
        return metrics

    def teacher_reference(self, run) -> dict | None:
        """The teacher's figures on the probe set, drawn once (by every rank of a collective teacher; the main rank
        keeps them); None where this rank holds no teacher."""
        teacher = getattr(run.targets, "teacher", None)
        if teacher is None or not self.draws_teacher:
            return None
        assert self.probe is not None  # checked by the caller
        if self.ctx.is_main:
            log.info(
                "hooks.collapse: the teacher draws its reference (%d images, %d steps), once for the run",
                len(self.probe.prompts),
                self.teacher_steps,
            )
        latents = probe_latents(
            teacher.spec, teacher.experts, teacher.guidance_scales, self.probe, self.teacher_steps, teacher.device
        )
        teacher.copy_ms()  # a streamed teacher's copies for the reference: not the next training step's
        if not self.ctx.is_main:
            return None
        return figures(decoded(self.ctx.spec, latents, self.ctx.device), self.probe.prompts, self.judge)

    def student_scheduler(self, ctx):
        """A few-step student's scheduler at the watch's steps, on the sigmas it is trained at (`method.schedule`)."""
        try:
            return few_step_scheduler(ctx.spec, self.student_steps, ctx.student_schedule)
        except UserError as e:
            raise UserError(f"hooks.collapse.steps={self.student_steps}: {e}") from None

    def student_figures(self, run) -> dict:
        """The student's figures on the probe set at its steps: a few-step student with its own schedule
        (teacher/fewstep.py), a KD student with the teacher's scheduler; no CFG either way."""

        assert self.probe is not None and self.student_steps is not None  # checked by the caller
        ctx, student = self.ctx, run.student
        scheduler = None if ctx.student_steps is None else self.student_scheduler(ctx)
        was_training = student.training
        student.eval()
        try:
            with sampling_transformers(student) as (transformers, guidance):
                latents = probe_latents(
                    ctx.spec, transformers, guidance, self.probe, self.student_steps, ctx.device, scheduler
                )
        finally:
            student.train(was_training)
        return figures(decoded(ctx.spec, latents, ctx.device), self.probe.prompts, self.judge)

    def advice(self, run) -> str:
        """What to try: a lower learning rate, a regression term (a method that has one), or fewer steps, from the
        last kept checkpoint of a check that looked healthy."""

        lr = self.ctx.trainer_cfg.get("optimizer", {}).get("lr")
        tries = [f"a lower trainer.optimizer.lr{f' (now {lr:g})' if isinstance(lr, (int, float)) else ''}"]
        weight = getattr(run.method, "regression_weight", None)  # dmd's; trajectory is a regression itself
        if weight is not None:
            tries.append(
                f"a larger method.regression_weight (now {weight:g})"
                if weight
                else "a regression term (method.regression_weight=0.1)"
            )
        if self.last_healthy is None:
            tries.append("fewer steps (no check has looked healthy yet)")
        else:
            kept = [p for p in list_checkpoints(Path(run.run_dir)) if 0 < checkpoint_step(p) <= self.last_healthy]
            # a checkpoint named by path continues in a new run folder (this one holds checkpoints)
            since = "no checkpoint of then is kept"
            if kept:
                since = f"trainer.resume={kept[-1]} hydra.run.dir=<a new folder>"
            tries.append(f"fewer steps since step {self.last_healthy}, the last check that looked healthy ({since})")
        return "try " + ", or ".join(tries)

    def motion_advice(self, run) -> str:
        """What to try when the clips stand still: a regression term on the teacher's trajectories (it keeps the
        teacher's motion), more of the teacher's steps for its targets, a lower learning rate, fewer steps."""
        tries = []
        weight = getattr(run.method, "regression_weight", None)  # dmd's
        if weight is not None:
            tries.append(
                f"a larger method.regression_weight (now {weight:g})"
                if weight
                else "a regression term (method.regression_weight=0.25)"
            )
        teacher_steps = getattr(run.method, "teacher_steps", None)
        if isinstance(teacher_steps, int):
            tries.append(f"more teacher steps for its targets (method.teacher_steps, now {teacher_steps})")
        lr = self.ctx.trainer_cfg.get("optimizer", {}).get("lr")
        tries.append(f"a lower trainer.optimizer.lr{f' (now {lr:g})' if isinstance(lr, (int, float)) else ''}")
        if self.last_healthy is not None:
            tries.append(f"fewer steps (step {self.last_healthy} was the last check that looked healthy)")
        return "try " + ", or ".join(tries)


OPTION = Option("collapse", CollapseConfig, CollapseWatch)
