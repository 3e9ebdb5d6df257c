"""wandistiller/recipe/hooks/progress.py: the progress line, driven directly with a tiny run history: which steps
log it, what it says, and where it goes with and without the progress bar."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from omegaconf import OmegaConf

from wandistiller.recipe.hooks.base import HookParts
from wandistiller.recipe.hooks.progress import ProgressLog
from wandistiller.train import run


def bound(progress_bar: bool) -> ProgressLog:
    hook = ProgressLog()
    trainer = OmegaConf.create({"log_every": 3, "max_steps": 7, "progress_bar": progress_bar})
    hook.bind(SimpleNamespace(trainer_cfg=trainer), HookParts())
    return hook


def test_a_line_every_log_every_steps_and_at_the_last_step(caplog):
    hook = bound(progress_bar=False)
    history = SimpleNamespace(history=[{"step": 1, "loss": 0.123456, "samples_per_s": 12.34, "lr": 3e-4}])
    with caplog.at_level(logging.INFO, logger="wandistiller"):
        for step in range(1, 8):
            hook(history, step)
    lines = [r.getMessage() for r in caplog.records if r.name == "wandistiller"]
    assert lines == [f"step {step}/7: loss 0.12346, 12.3 samples/s, lr 0.0003" for step in (3, 6, 7)]


def test_a_slow_run_shows_its_rate_in_significant_figures_not_zero(caplog):
    slow = SimpleNamespace(history=[{"step": 3, "loss": 1.0, "samples_per_s": 0.0321, "lr": 1e-4}])
    with caplog.at_level(logging.INFO, logger="wandistiller"):
        bound(progress_bar=False)(slow, 3)
    assert [r.getMessage() for r in caplog.records] == ["step 3/7: loss 1.00000, 0.0321 samples/s, lr 0.0001"]


def test_before_any_logged_step_the_line_says_so_rather_than_failing(caplog):
    with caplog.at_level(logging.INFO, logger="wandistiller"):
        bound(progress_bar=False)(SimpleNamespace(history=[]), 3)
    assert [r.getMessage() for r in caplog.records] == ["step 3/7: loss nan, 0 samples/s, lr 0"]


def test_with_the_progress_bar_the_line_goes_to_the_log_file_alone(caplog, tmp_path):
    log_file = logging.FileHandler(tmp_path / "train.log")
    logging.getLogger().addHandler(log_file)  # as Hydra's job logging does
    try:
        with caplog.at_level(logging.INFO, logger="wandistiller"):
            bound(progress_bar=True)(SimpleNamespace(history=[{"loss": 1.0}]), 6)
    finally:
        logging.getLogger().removeHandler(log_file)
        log_file.close()
    assert "step 6/7: loss 1.00000" in (tmp_path / "train.log").read_text()
    assert not caplog.records  # not between the bar's redraws on the terminal


def test_train_log_shows_progress_every_log_every_steps(make_cfg, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="wandistiller")
    run(make_cfg("trainer.max_steps=4", "trainer.log_every=2", run_dir=tmp_path / "r"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 2/4", "step 4/4"]
    assert "samples/s" in lines[0] and "loss" in lines[0]
