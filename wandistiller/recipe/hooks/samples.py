"""`hooks.samples`: the teacher-vs-student grid every `trainer.sample_every` steps, into
`samples/step_XXXXXXXX.png` and to the loggers (the teacher's column drawn once, before training)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from wandistiller.core.registry import Option
from wandistiller.recipe.hooks.base import Hook


@dataclass
class SamplesConfig:
    _target_: str = "wandistiller.recipe.hooks.samples.SampleGrids"


class SampleGrids(Hook):
    def __init__(self):
        self.every, self.samples = 0, None

    def bind(self, ctx, parts) -> None:
        self.every, self.samples = ctx.trainer_cfg.sample_every, parts.samples

    def __call__(self, run, step: int) -> None:
        if self.samples is None or self.every <= 0 or step % self.every:
            return
        path = self.samples(run.student, Path(run.run_dir) / "samples" / f"step_{step:08d}.png")
        run.tracker.log_image("samples", path, step=step)


OPTION = Option("samples", SamplesConfig, SampleGrids)
