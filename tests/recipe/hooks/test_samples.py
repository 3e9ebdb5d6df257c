"""wandistiller/recipe/hooks/samples.py: the periodic sample grid hook, driven directly with a recording drawer
and tracker: which steps draw, the file each step's grid goes to, and when it does nothing."""

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
    hook = SampleGrids()
    hook.bind(SimpleNamespace(trainer_cfg=OmegaConf.create({"sample_every": sample_every})), HookParts(samples=drawer))
    run = SimpleNamespace(student="the student", run_dir=run_dir, tracker=ImageTracker())
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
