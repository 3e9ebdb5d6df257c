"""`loss=distillation` (default): the teacher's guided velocity (MSE), + optional hidden-state KD."""

from __future__ import annotations

import torch

from wandistiller.recipe.losses.base import LossInputs, hidden_mse, velocity_mse


class Distillation:
    """The teacher's guided velocity (MSE), plus hidden-state MSE weighted by `hidden_kd_weight`."""

    def __init__(self, hidden_kd_weight: float = 0.0):
        self.hidden_kd_weight = hidden_kd_weight
        self.needs = frozenset({"teacher"} | ({"teacher_hidden"} if hidden_kd_weight > 0 else set()))

    def __call__(self, inputs: LossInputs) -> dict[str, torch.Tensor]:
        velocity, hidden = velocity_mse(inputs), hidden_mse(inputs, self.hidden_kd_weight)
        return {"loss": velocity + self.hidden_kd_weight * hidden, "velocity": velocity, "hidden": hidden}


LOSS = Distillation
