"""wandistiller/evaluation/logged.py: the step an evaluation's numbers belong at, and a logger that cannot take an
earlier step (wandb) taking them at its own next one."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from wandistiller.evaluation.logged import evaluated_step


def test_an_evaluated_students_step_is_its_checkpoints_or_the_runs_last(tmp_path):
    from wandistiller.state.checkpoint import STATE_FILE

    run_dir = tmp_path / "run"
    for step in (3, 10):  # a checkpoint's step is the one its state records, not its name's
        (run_dir / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step_{step:08d}" / STATE_FILE).write_text(json.dumps({"step": step}))
    (run_dir / "checkpoints" / "best").mkdir()
    (run_dir / "checkpoints" / "best" / STATE_FILE).write_text(json.dumps({"step": 3}))
    assert evaluated_step(run_dir, run_dir / "checkpoints" / "best") == 3
    assert evaluated_step(run_dir, run_dir / "student") == 10  # no metrics.json: the latest checkpoint
    (run_dir / "metrics.json").write_text(json.dumps({"final_step": 12}))
    assert evaluated_step(run_dir, run_dir / "student") == 12  # written with the final student
    assert evaluated_step(tmp_path / "bare", tmp_path / "bare" / "student") is None


@pytest.mark.slow  # a real offline wandb run: seconds to start
def test_wandb_past_the_evaluated_step_takes_the_numbers_at_its_own_next_step(tmp_path):
    from wandistiller.tracking.loggers.wandb import WandbTracker

    wandb = WandbTracker(project="wandistiller", mode="offline")
    wandb.start(tmp_path, {}, None)
    try:
        wandb.log({"loss": 1.0}, step=5)  # a resumed online run is past the run's last step
        assert wandb._at({"eval/psnr": 9.0}, 3) == ({"eval/psnr": 9.0, "eval/step": 3}, None)  # not dropped
        assert wandb._at({"eval/psnr": 9.0}, 5) == ({"eval/psnr": 9.0}, 5)
        assert wandb._at({"eval/psnr": 9.0}, None) == ({"eval/psnr": 9.0}, None)  # no step known: its own next
        wandb.log({"eval/psnr": 9.0}, step=3)
        assert wandb.run.step == 6  # logged at the next step instead of dropped with a warning
    finally:
        wandb.finish({})


def test_a_later_process_reopens_a_file_logger_as_it_is_and_wandb_only_with_the_runs_id():
    from wandistiller.tracking.loggers.csv import CsvLogger
    from wandistiller.tracking.loggers.wandb import WandbTracker

    node = OmegaConf.create({"_target_": "x", "mode": "offline", "project": "p"})
    assert CsvLogger.reopened(node, None) is node
    assert WandbTracker.reopened(node, None) is None  # no run to continue: no stray run for one evaluation
    assert WandbTracker.reopened(node, "abc123", "online").mode == "online"
