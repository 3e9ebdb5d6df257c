"""`hooks.samples`: when the teacher-vs-student grids are drawn -- every `hooks.samples.every` steps into
`samples/step_XXXXXXXX.png`, and at the end into `samples.png` -- and logged. The drawing (the teacher's column
drawn once, before training, and each grid) is recipe/samples.py's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from wandistiller.core.registry import Option
from wandistiller.recipe.hooks.base import Hook, at_least, sample_steps


@dataclass
class SamplesConfig:
    _target_: str = "wandistiller.recipe.hooks.samples.SampleGrids"
    # The grid every N steps into samples/step_XXXXXXXX.png; 0 = only samples.png at the end.
    every: int = 100
    # Prompts shown (0 = no grids at all) and the sampling steps of each image.
    prompts: int = 4
    steps: int = 10


class SampleGrids(Hook):
    """The grids' schedule; what they show (`prompts`, `steps`) is drawn by recipe/samples.py, the teacher's column
    before training (the recipe asks the registry for the hook that `draws_samples`)."""

    draws_samples = True

    def __init__(
        self, every: int = SamplesConfig.every, prompts: int = SamplesConfig.prompts, steps: int = SamplesConfig.steps
    ):
        self.every = at_least("hooks.samples.every", every, 0)
        self.prompts = at_least("hooks.samples.prompts", prompts, 0)
        self.steps = sample_steps("hooks.samples.steps", steps)
        self.last_step, self.samples = 0, None

    def bind(self, ctx, parts) -> None:
        self.last_step, self.samples = ctx.trainer_cfg.max_steps, parts.samples

    def __call__(self, run, step: int) -> None:
        if self.samples is None or self.every <= 0 or step % self.every:
            return
        path = self.samples(run.student, Path(run.run_dir) / "samples" / f"step_{step:08d}.png")
        self.logged(run, path, step)

    def at_end(self, run) -> dict:
        """The trained student's grid, `samples.png`, logged at the last step."""
        if self.samples is not None:
            path = self.samples(run.student, Path(run.run_dir) / "samples.png")
            self.logged(run, path, self.last_step)
        return {}

    def logged(self, run, path: Path, step: int) -> None:
        """The grid into the run's loggers; a clip run's animation too (`samples_clips`: video where the logger
        has it, its still strip where not)."""
        run.tracker.log_image("samples", path, step=step)
        if getattr(self.samples, "clips", False):
            run.tracker.log_video("samples_clips", path.with_suffix(".gif"), step=step)


OPTION = Option("samples", SamplesConfig, SampleGrids)
