"""`hooks.samples`: when the teacher-vs-student grids are drawn -- every `trainer.sample_every` steps into
`samples/step_XXXXXXXX.png`, and at the end into `samples.png` -- and logged. The drawing (the teacher's column
drawn once, before training, and each grid) is recipe/samples.py's."""

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
        self.every, self.last_step, self.samples = 0, 0, None

    def bind(self, ctx, parts) -> None:
        t = ctx.trainer_cfg
        self.every, self.last_step, self.samples = t.sample_every, t.max_steps, parts.samples

    def __call__(self, run, step: int) -> None:
        if self.samples is None or self.every <= 0 or step % self.every:
            return
        path = self.samples(run.student, Path(run.run_dir) / "samples" / f"step_{step:08d}.png")
        run.tracker.log_image("samples", path, step=step)

    def at_end(self, run) -> dict:
        """The trained student's grid, `samples.png`, logged at the last step."""
        if self.samples is not None:
            path = self.samples(run.student, Path(run.run_dir) / "samples.png")
            run.tracker.log_image("samples", path, step=self.last_step)
        return {}


OPTION = Option("samples", SamplesConfig, SampleGrids)
