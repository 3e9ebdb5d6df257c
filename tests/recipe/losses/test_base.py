"""wandistiller/recipe/losses/base.py: the loss interface's arithmetic (parts, total, logged metrics, the old-shape
wrapper) on fixed tensors whose MSEs are known."""

from __future__ import annotations

import pytest
import torch

from wandistiller.recipe.losses.base import (
    LAST,
    Legacy,
    LossInputs,
    Needs,
    hidden_mse,
    logged,
    task_mse,
    total,
    velocity_mse,
)


def inputs(**changed) -> LossInputs:
    base = dict(
        pred=torch.ones(2, 3), student_hidden=(torch.ones(2, 4),), target=torch.zeros(2, 3),
        teacher_hidden=(torch.full((2, 4), 3.0),), x0=torch.full((2, 3), 1.0), noise=torch.full((2, 3), 4.0),
        t=torch.tensor([10.0, 900.0]),
    )  # fmt: skip
    return LossInputs(**(base | changed))


def test_the_three_mses_compare_in_float32_whatever_the_prediction_dtype():
    half = inputs(pred=torch.ones(2, 3, dtype=torch.bfloat16))
    assert velocity_mse(half).dtype == torch.float32 and velocity_mse(half) == 1.0
    assert hidden_mse(half) == 4.0  # (1 - 3)^2
    assert task_mse(half).dtype == torch.float32 and task_mse(half) == 4.0  # (1 - (4 - 1))^2


def test_hidden_mse_pairs_the_given_blocks():
    two = inputs(
        student_hidden=(torch.ones(2, 4), torch.zeros(2, 4)), teacher_hidden=(torch.ones(2, 4), torch.ones(2, 4))
    )
    assert hidden_mse(two, 0) == 0.0 and hidden_mse(two, 1) == 1.0


def test_needs_from_the_older_names_and_their_pairing():
    assert Needs.of({"teacher"}) == Needs(teacher=True)
    assert Needs.of(frozenset({"teacher", "teacher_hidden", "x0"})) == Needs(True, LAST, LAST, True)
    assert Needs(teacher_hidden=(3,), student_hidden=(1,)).teacher_runs and not Needs(x0=True).teacher_runs
    with pytest.raises(ValueError, match="a loss may need"):
        Needs.of({"teacher", "gradients"})
    with pytest.raises(ValueError, match="pair up"):
        Needs(teacher_hidden=(1, 2), student_hidden=(0,))


def test_total_trains_on_the_loss_part_when_given_else_on_the_sum():
    two, three = torch.tensor(2.0), torch.tensor(3.0)
    assert total({"a": two, "b": three}) == 5.0
    assert total({"loss": torch.tensor(7.0), "a": two, "b": three}) == 7.0


def test_logged_names_each_part_and_detaches_it():
    part = torch.tensor(2.0, requires_grad=True)
    metrics = logged({"velocity": part * 1, "hidden": part * 2})
    assert set(metrics) == {"loss", "loss_velocity", "loss_hidden"} and metrics["loss"] == 6.0
    assert not any(v.requires_grad for v in metrics.values())


def test_an_old_shape_function_is_called_positionally_and_its_triple_named():
    seen = []

    def old(pred, target, student_hidden, teacher_hidden):
        seen.append((pred, target, student_hidden, teacher_hidden))
        return torch.tensor(3.0), torch.tensor(1.0), torch.tensor(2.0)

    given = inputs()
    parts = Legacy(old, want_hidden=True)(given)
    assert parts == {"loss": 3.0, "velocity": 1.0, "hidden": 2.0} and total(parts) == 3.0
    assert seen == [(given.pred, given.target, given.student_hidden[0], given.teacher_hidden[0])]
    assert Legacy(old, want_hidden=False).needs == Needs(teacher=True)
    assert Legacy(old, want_hidden=True).needs == Needs.of({"teacher", "teacher_hidden"})
