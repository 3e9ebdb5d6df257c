"""wandistiller/recipe/hooks/monitor.py in real runs: validation per noise band, checkpoints/best (kept across a
resume), loss.png and the metrics appended as they happen (past a torn line); and three runs on other data
sources (data/), which belong in tests/data/."""

from __future__ import annotations

import json

import pytest

from tests.conftest import metrics_steps
from wandistiller.state.checkpoint import load_checkpoint
from wandistiller.train import run


@pytest.mark.slow  # a whole run: the default lane keeps its 4 minutes
def test_validation_best_checkpoint_grids_and_eval_as_the_run_goes(make_cfg, tmp_path):
    run_dir = tmp_path / "r"
    overrides = ["trainer.max_steps=4", "hooks=[monitor,progress,samples,evaluate]", "hooks.monitor.val_every=2",
                 "hooks.samples.every=2", "hooks.samples.prompts=1", "hooks.samples.steps=2", "hooks.evaluate.steps=2",
                 "trainer.checkpoint_every=10"]  # fmt: skip
    summary = run(make_cfg(*overrides, run_dir=run_dir))
    val = [r for r in metrics_steps(run_dir) if "val/loss" in r]
    assert [r["step"] for r in val] == [2, 4]
    assert {"val/loss_t<250", "val/loss_250-750", "val/loss_t>750"} <= set(val[0])
    best = load_checkpoint(run_dir / "checkpoints" / "best")
    assert best["val"]["val/loss"] == min(r["val/loss"] for r in val) == summary["val_loss_best"]
    assert (run_dir / "loss.png").is_file() and (run_dir / "samples.png").is_file()
    assert sorted(p.name for p in (run_dir / "samples").iterdir()) == ["step_00000002.png", "step_00000004.png"]
    assert summary["eval_latent_mse"] >= 0 and (run_dir / "eval.json").is_file()
    # Deterministic: the same run gives the same held-out losses.
    again = tmp_path / "again"
    run(make_cfg(*overrides, "hooks.samples.every=0", run_dir=again))
    assert [r["val/loss"] for r in metrics_steps(again) if "val/loss" in r] == [r["val/loss"] for r in val]


def test_a_resume_keeps_a_better_best_and_survives_a_torn_metrics_line(make_cfg, tmp_path):
    """checkpoints/best is replaced only by a better one after a resume; a half-written metrics line (a kill
    mid-write) neither fails the end of the run nor swallows the rows written after it."""
    from wandistiller.data.validation import recorded_rows

    run_dir = tmp_path / "r"
    common = ["hooks.monitor.val_every=2", "trainer.checkpoint_every=2"]
    run(make_cfg(*common, "trainer.max_steps=2", run_dir=run_dir))
    state_file = run_dir / "checkpoints" / "best" / "state.json"
    state = json.loads(state_file.read_text())
    state["val"]["val/loss"] = 1e-9  # a best no later validation can beat
    state_file.write_text(json.dumps(state))
    (run_dir / "metrics.json").unlink()
    (run_dir / "student").rename(tmp_path / "student_first")
    with (run_dir / "metrics_steps.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')  # torn
    summary = run(make_cfg(*common, "trainer.max_steps=4", "trainer.resume=auto", run_dir=run_dir))
    assert json.loads(state_file.read_text())["step"] == 2  # not replaced by step 4's worse checkpoint
    assert summary["final_step"] == 4 and [r["step"] for r in recorded_rows(run_dir) if "loss" in r] == [1, 2, 3, 4]


def test_a_few_step_student_logs_val_loss_but_keeps_no_best_checkpoint(make_cfg, tmp_path, caplog):
    """val/loss is a KD student's velocity error; a K-step student is judged by what it samples (eval)."""
    import logging

    run_dir = tmp_path / "fewstep"
    with caplog.at_level(logging.INFO, logger="wandistiller"):
        run(make_cfg("method=trajectory", "method.steps=2", "method.teacher_steps=2", "method.noises_per_prompt=1",
                     "trainer.max_steps=2", "hooks.monitor.val_every=1", "trainer.checkpoint_every=10",
                     run_dir=run_dir))  # fmt: skip
    assert [r["step"] for r in metrics_steps(run_dir) if "val/loss" in r] == [1, 2]
    assert not (run_dir / "checkpoints" / "best").exists()
    assert "a 2-step student is judged by what it samples: no checkpoints/best/" in caplog.text
