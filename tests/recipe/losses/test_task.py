"""wandistiller/recipe/losses/task.py: `loss=task`'s flow velocity on fixed tensors, with no teacher at all."""

from __future__ import annotations

import torch

from tests.recipe.losses.test_base import inputs
from wandistiller.recipe.losses import logged, total
from wandistiller.recipe.losses.base import Needs
from wandistiller.recipe.losses.task import Task


def test_task_is_the_flow_velocity_of_the_data_and_needs_no_teacher():
    # velocity = noise - x0 = 3 everywhere; the prediction is 1: MSE 4, whatever the teacher says.
    parts = Task()(inputs(target=None, teacher_hidden=None))
    assert parts == {"task": 4.0} and total(parts) == 4.0 and Task.needs == Needs(x0=True)
    assert set(logged(parts)) == {"loss", "loss_task"}


def test_task_reads_neither_the_teacher_nor_hidden_states():
    exact = inputs(pred=torch.full((2, 3), 3.0), target=None, teacher_hidden=None, student_hidden=None)
    assert Task()(exact) == {"task": 0.0}
