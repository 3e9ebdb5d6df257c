"""wandistiller/recipe/losses/distillation.py: `loss=distillation`'s parts on fixed tensors whose MSEs are known."""

from __future__ import annotations

import pytest
import torch

from tests.recipe.losses.test_base import inputs
from wandistiller.core.errors import UserError
from wandistiller.recipe.losses import logged, total
from wandistiller.recipe.losses.base import LAST, Needs
from wandistiller.recipe.losses.distillation import Distillation


def test_distillation_keeps_the_old_loss_and_its_metric_names():
    parts = Distillation(hidden_kd_weight=0.5)(inputs())
    assert parts["velocity"] == 1.0 and parts["hidden"] == 4.0 and total(parts) == 3.0
    assert set(logged(parts)) == {"loss", "loss_velocity", "loss_hidden"}
    assert Distillation().needs == Needs(teacher=True)
    assert Distillation(0.5).needs == Needs(teacher=True, teacher_hidden=LAST, student_hidden=LAST)
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(UserError, match=r"trainer\.loss\.hidden_kd_weight=.* must be 0 or more"):
            Distillation(bad)


def test_without_a_hidden_weight_the_loss_is_the_velocity_mse_alone():
    parts = Distillation()(inputs(student_hidden=None, teacher_hidden=None, pred=torch.full((2, 3), 2.0)))
    assert parts["velocity"] == 4.0 and parts["hidden"] == 0.0 and total(parts) == 4.0
