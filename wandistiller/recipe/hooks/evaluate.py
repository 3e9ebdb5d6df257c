"""`hooks.evaluate` (in the default `hooks` list): the end of a run evaluates the student against its teacher
(`python -m wandistiller.eval`'s `evaluate`, from the same noise, prompts and sampler) and adds the means to
metrics.json (`eval_*`) and the loggers."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from wandistiller.core.registry import Option
from wandistiller.data.prompts import read_prompts
from wandistiller.data.sources import image_conditioned
from wandistiller.evaluation.evaluate import EvalSettings, evaluate
from wandistiller.recipe.hooks.base import Hook, at_least, sample_steps
from wandistiller.state.sampling import check_images
from wandistiller.state.trust import Trust

log = logging.getLogger("wandistiller")


@dataclass
class EvaluateConfig:
    _target_: str = "wandistiller.recipe.hooks.evaluate.EvaluateAtEnd"
    # Sampling steps of the teacher and a KD student (a few-step student samples at its own K), and images per
    # held-out prompt (`python -m wandistiller.eval --steps, --per-prompt`): FID/KID are given from 65 images on,
    # withheld below; intra-prompt diversity from 2 a prompt.
    steps: int = 10
    per_prompt: int = 1
    # The prompts (a file, one per line; None: the run's held-out prompts), at most `limit` of them.
    prompts_path: str | None = None
    limit: int = 8


class EvaluateAtEnd(Hook):
    """`hooks.evaluate`: the student against its teacher from the same noise at the end
    of the run, its means for metrics.json (`eval_*`) and the loggers. It runs where the whole teacher fits on one
    device (the placement says: `whole_on_one_device`); the training teacher is freed by then, eval loads its own."""

    def __init__(
        self,
        steps: int = EvaluateConfig.steps,
        per_prompt: int = EvaluateConfig.per_prompt,
        prompts_path: str | None = EvaluateConfig.prompts_path,
        limit: int = EvaluateConfig.limit,
    ):
        # Each setting checked now, named by its key, not by eval's flags once the training is done.
        self.steps = sample_steps("hooks.evaluate.steps", steps)
        self.per_prompt = at_least("hooks.evaluate.per_prompt", per_prompt, 1)
        self.limit = at_least("hooks.evaluate.limit", limit, 1)
        if prompts_path is not None:
            read_prompts(prompts_path, "hooks.evaluate.prompts_path")
        self.prompts_path = prompts_path

    def bind(self, ctx, parts) -> None:
        self.ctx, self.targets = ctx, parts.targets
        if ctx.placement.whole_on_one_device:  # it will run: the images it holds at once, before the first step
            asked = f"hooks.evaluate.per_prompt={self.per_prompt} (x hooks.evaluate.limit={self.limit})"
            check_images(ctx.latent_shape, ctx.spec.path, self.limit * self.per_prompt, asked)

    def at_end(self, run) -> dict:
        ctx = self.ctx
        if not ctx.placement.whole_on_one_device:
            log.info(
                "hooks.evaluate: skipped, teacher_placement=%s (eval loads the whole teacher on one "
                "device); run python -m wandistiller.eval %s where it fits",
                ctx.placement.name,
                ctx.run_dir,
            )
            return {}
        given = "hooks.evaluate.prompts_path" if self.prompts_path else "data.val_prompts_path"
        if image_conditioned(ctx.data_cfg, ctx.spec.layout) and (self.prompts_path or ctx.data_cfg.val_prompts_path):
            # An image-to-video student continues its held-out captions' own first frames; other prompts have none.
            log.info(
                "hooks.evaluate: skipped, an image-to-video run whose eval prompts (%s) have no first frames; "
                "python -m wandistiller.generate %s --image FILE draws its student from yours",
                given,
                ctx.run_dir,
            )
            return {}

        # What it costs is said once measured, after each sampler's first image (state/sampling.py): the training's
        # teacher pace, at its batch, put a batch-1 evaluation at a third to a fifth of what it took.
        log.info(  # what it is, said before it is paid, and how not to pay it
            "hooks.evaluate: the student against its teacher on up to %d held-out prompt(s) x %d image(s), the teacher "
            "at %d steps with CFG (its time said after the first image); ~hooks.evaluate skips it (python -m "
            "wandistiller.eval %s runs it later), and Ctrl-C now keeps the trained student",
            self.limit,
            self.per_prompt,
            self.steps,
            ctx.run_dir,
        )
        # The run's own folder, written by this process: its targets, cache and teacher are the user's own.
        own = Trust(self.targets, ctx.teacher_path, cache_dir=ctx.cache_dir, own_files=True, spec=ctx.spec)
        asked = EvalSettings(
            prompts_path=self.prompts_path, steps=self.steps, limit=self.limit, per_prompt=self.per_prompt,
            device=ctx.device, trust=own,
        )  # fmt: skip
        result = evaluate(ctx.run_dir, asked)
        run.tracker.log({f"eval/{k}": v for k, v in result["mean"].items()}, step=ctx.trainer_cfg.max_steps)
        if len(result["files"]) > 2:  # a clip run: its teacher | student animation (eval.gif), as a video
            run.tracker.log_video("eval_clips", Path(ctx.run_dir) / result["files"][2], step=ctx.trainer_cfg.max_steps)
        return {f"eval_{k}": v for k, v in result["mean"].items()}


OPTION = Option("evaluate", EvaluateConfig, EvaluateAtEnd)
