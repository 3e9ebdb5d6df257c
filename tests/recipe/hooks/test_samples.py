"""wandistiller/recipe/hooks/samples.py: the sample grid hook, driven directly with a recording drawer and tracker:
which steps draw, the file each step's grid goes to, the last grid at the end, and when it does nothing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from omegaconf import OmegaConf

from wandistiller.recipe.hooks.base import HookParts
from wandistiller.recipe.hooks.samples import SampleGrids
from wandistiller.tracking.loggers import NullTracker


class ImageTracker(NullTracker):
    """A tracker that keeps the images the hook logs."""

    def __init__(self):
        self.images: list[tuple[str, Path, int]] = []

    def log_image(self, key, path, step) -> None:
        self.images.append((key, path, step))


def drive(sample_every: int, drawer, steps=range(1, 7), run_dir="/runs/r") -> SimpleNamespace:
    hook = SampleGrids(every=sample_every)
    trainer = OmegaConf.create({"max_steps": 6})
    hook.bind(SimpleNamespace(trainer_cfg=trainer), HookParts(samples=drawer))
    run = SimpleNamespace(student="the student", run_dir=run_dir, tracker=ImageTracker(), hook=hook)
    for step in steps:
        hook(run, step)
    return run


def test_every_sample_every_steps_the_student_is_drawn_into_its_steps_file_and_logged():
    drawn = []
    run = drive(3, lambda student, path: drawn.append((student, path)) or path)
    grids = [Path("/runs/r/samples/step_00000003.png"), Path("/runs/r/samples/step_00000006.png")]
    assert drawn == [("the student", grids[0]), ("the student", grids[1])]
    assert run.tracker.images == [("samples", grids[0], 3), ("samples", grids[1], 6)]


def test_no_drawer_or_no_period_draws_nothing():
    drawn = []
    assert drive(0, lambda student, path: drawn.append(path) or path).tracker.images == []
    assert drive(2, None).tracker.images == [] and drawn == []


def test_at_the_end_the_trained_student_is_drawn_into_samples_png_and_logged_at_the_last_step():
    drawn = []
    run = drive(0, lambda student, path: drawn.append((student, path)) or path, steps=())
    assert run.hook.at_end(run) == {}
    assert drawn == [("the student", Path("/runs/r/samples.png"))]
    assert run.tracker.images == [("samples", Path("/runs/r/samples.png"), 6)]
    nothing = drive(3, None, steps=())
    assert nothing.hook.at_end(nothing) == {} and nothing.tracker.images == []


def test_steps_past_the_schedulers_timesteps_are_one_line_when_the_hook_is_built():
    """Issue 41: hooks.samples.steps=5000 was accepted (eval and generate refuse it) and drew every grid at it."""
    import pytest

    from wandistiller.core.errors import UserError

    with pytest.raises(UserError, match=r"^hooks.samples.steps=5000 is more than a Wan scheduler's 1000 training"):
        SampleGrids(steps=5000)
    assert SampleGrids(steps=1000).steps == 1000
