"""Training that goes non-finite stops at the first such step with one line; values that cannot train
(an infinite shift or learning rate, a NaN weight) are refused before anything loads."""

from __future__ import annotations

import pytest

from wandistiller.core.errors import UserError
from wandistiller.recipe.loop import distillation_loss
from wandistiller.state.checkpoint import list_checkpoints
from wandistiller.train import run

CALLS: list[int] = []


def nan_from_third_call(pred, target, student_hidden, teacher_hidden, hidden_kd_weight: float = 0.0):
    """The shipped loss, turned NaN from its third call on (what an overflowing loss term does)."""
    loss, velocity, hidden = distillation_loss(pred, target, student_hidden, teacher_hidden, hidden_kd_weight)
    CALLS.append(1)
    return (loss * float("nan") if len(CALLS) >= 3 else loss), velocity, hidden


def test_a_nan_loss_stops_at_its_step_and_keeps_the_last_good_checkpoint(make_cfg, tmp_path):
    CALLS.clear()
    folder = tmp_path / "run"
    cfg = make_cfg("trainer.max_steps=5", "trainer.checkpoint_every=1", "trainer.log_every=2",
                   f"trainer.loss._target_={__name__}.nan_from_third_call", run_dir=folder)  # fmt: skip
    with pytest.raises(UserError, match=r"non-finite at step 3 \(loss nan.*the last good checkpoint is step_00000002"):
        run(cfg)
    assert [p.name for p in list_checkpoints(folder)] == ["step_00000001", "step_00000002"]
    assert not (folder / "metrics.json").exists() and not (folder / "student").exists()  # never "completed"


@pytest.mark.parametrize(
    "override, message",
    [
        ("teacher.flow_shift=inf", "teacher.flow_shift=inf must be positive"),
        ("trainer.optimizer.lr=inf", "trainer.optimizer.lr=inf must be a finite number"),
        ("trainer.optimizer.lr=1e6", r"trainer.optimizer.lr=1000000.0 must be a finite number in \[0, 10\]"),
        ("student.hidden_kd_weight=nan", "student.hidden_kd_weight=nan must be a finite number"),
        ("seed=-1", r"seed=-1 must be in \[0, 2\*\*63\)"),
    ],
)
def test_values_that_cannot_train_are_refused_first(make_cfg, tmp_path, override, message):
    with pytest.raises(UserError, match=message):
        run(make_cfg(override))
    assert not (tmp_path / "run").exists()
