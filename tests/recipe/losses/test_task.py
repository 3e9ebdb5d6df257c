"""wandistiller/recipe/losses/task.py: `loss=task`'s flow velocity on fixed tensors, with no teacher at all."""

from __future__ import annotations

import torch

from tests.recipe.losses.test_base import inputs
from wandistiller.recipe.losses import Task, logged, total


def test_task_is_the_flow_velocity_of_the_data_and_needs_no_teacher():
    # velocity = noise - x0 = 3 everywhere; the prediction is 1: MSE 4, whatever the teacher says.
    parts = Task()(inputs(target=None, teacher_hidden=None))
    assert parts == {"task": 4.0} and total(parts) == 4.0 and Task.needs == {"x0"}
    assert set(logged(parts)) == {"loss", "loss_task"}


def test_task_takes_the_shared_hidden_weight_key_and_ignores_it():
    # Every option is built with hidden_kd_weight (as_loss, student.hidden_kd_weight): task must accept it.
    exact = inputs(pred=torch.full((2, 3), 3.0), target=None, teacher_hidden=None, student_hidden=None)
    assert Task(hidden_kd_weight=0.5)(exact) == {"task": 0.0}
