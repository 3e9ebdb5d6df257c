"""The loop and what a user swaps through `_target_`: the loss, the student builder, the recipe."""

from __future__ import annotations

import json

import torch
from conftest import run_cli

from wandistiller.recipe.distillation import DistillationRecipe
from wandistiller.recipe.loop import distillation_loss
from wandistiller.student.model import build_student
from wandistiller.train import run

CALLS: list[str] = []


def doubled_loss(pred, target, student_hidden, teacher_hidden, hidden_kd_weight: float = 0.0):
    """A user's loss: twice the velocity MSE (what trainer.loss._target_ may name)."""
    loss, velocity, hidden = distillation_loss(pred, target, student_hidden, teacher_hidden, hidden_kd_weight)
    CALLS.append("loss")
    return 2 * loss, velocity, hidden


def counted_student(spec, dtype=torch.float32, **student_keys):
    """A user's student builder (what student._target_ may name)."""
    CALLS.append("student")
    return build_student(spec, dtype, **student_keys)


class CountingRecipe(DistillationRecipe):
    """A user's recipe (what recipe._target_ may name): one setup step replaced."""

    def _setup_tracker(self, state):
        CALLS.append("tracker")
        return super()._setup_tracker(state)


def test_the_distillation_loss_is_velocity_mse_plus_weighted_hidden_mse():
    pred, target = torch.ones(2, 3), torch.zeros(2, 3)
    hs, ht = torch.ones(2, 4), torch.full((2, 4), 3.0)
    loss, velocity, hidden = distillation_loss(pred, target, hs, ht, hidden_kd_weight=0.5)
    assert velocity == 1.0 and hidden == 4.0 and loss == 3.0
    loss, _, hidden = distillation_loss(pred, target, None, None)
    assert loss == 1.0 and hidden == 0.0


def test_loss_student_and_recipe_are_swapped_through_their_targets(make_cfg, tmp_path):
    CALLS.clear()
    cfg = make_cfg(
        "trainer.max_steps=2",
        "trainer.loss._target_=test_loop.doubled_loss",
        "student._target_=test_loop.counted_student",
        "recipe._target_=test_loop.CountingRecipe",
        run_dir=tmp_path / "r",
    )
    summary = run(cfg)
    assert summary["steps_run"] == 2
    assert CALLS.count("student") == 1 and CALLS.count("tracker") == 1 and CALLS.count("loss") == 2


def test_a_target_that_does_not_exist_is_one_line(tmp_path, cache_dir):
    result = run_cli(
        f"hydra.run.dir={tmp_path / 'r'}", f"paths.cache_dir={cache_dir}", "logger=none",
        "recipe._target_=nowhere.Recipe",
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr and "recipe._target_" in result.stderr
    assert not (tmp_path / "r").exists()  # refused before the run folder is claimed


KEYS = {"step", "loss", "loss_velocity", "loss_hidden", "grad_norm", "lr", "samples_per_s", "step_ms"}
KEYS |= {"teacher_ms", "student_ms", "host_peak_rss_gib"}


def steps(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics_steps.jsonl").read_text().splitlines()]


def test_logging_every_few_steps_keeps_every_steps_metrics_and_values(make_cfg, tmp_path):
    # The loop reads its numbers from the device only when it logs: grouped steps equal per-step ones.
    common = ["trainer.max_steps=5", "trainer.checkpoint_every=2", "trainer.batch_size=2"]
    run(make_cfg(*common, "trainer.log_every=1", run_dir=tmp_path / "each"))
    run(make_cfg(*common, "trainer.log_every=3", run_dir=tmp_path / "grouped"))
    each, grouped = steps(tmp_path / "each"), steps(tmp_path / "grouped")
    assert [s["step"] for s in grouped] == [1, 2, 3, 4, 5]
    assert all(KEYS <= set(s) for s in grouped)
    assert all(s["step_ms"] > s["teacher_ms"] > 0 and s["samples_per_s"] > 0 for s in grouped)
    for key in ("loss", "loss_velocity", "loss_hidden", "grad_norm", "lr"):
        assert [s[key] for s in grouped] == [s[key] for s in each], key
