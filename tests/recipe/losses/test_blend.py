"""wandistiller/recipe/losses/blend.py: `loss=blend`'s weighting on fixed tensors, and its refusal of a weight
outside [0, 1]."""

from __future__ import annotations

import pytest

from tests.recipe.losses.test_base import inputs
from wandistiller.core.errors import UserError
from wandistiller.recipe.losses import total
from wandistiller.recipe.losses.base import LAST, Needs
from wandistiller.recipe.losses.blend import Blend


def test_blend_weighs_task_and_distillation():
    parts = Blend(alpha=0.25)(inputs())
    assert parts["task"] == 4.0 and parts["velocity"] == 1.0 and total(parts) == 0.25 * 4 + 0.75 * 1
    assert Blend(alpha=1.0)(inputs())["loss"] == 4.0 and Blend().needs == Needs(teacher=True, x0=True)
    with pytest.raises(UserError, match="trainer.loss.alpha=1.5"):
        Blend(alpha=1.5)


def test_blend_carries_the_hidden_part_and_what_it_needs():
    parts = Blend(alpha=0.0, hidden_kd_weight=0.5)(inputs())
    assert parts["hidden"] == 4.0 and total(parts) == 1.0 + 0.5 * 4.0  # alpha 0: distillation alone
    assert Blend(hidden_kd_weight=0.5).needs == Needs(True, LAST, LAST, True)
    with pytest.raises(UserError, match=r"trainer.loss.alpha=-0.1 is outside \[0, 1\]"):
        Blend(alpha=-0.1)
