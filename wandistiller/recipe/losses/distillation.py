"""`loss=distillation` (default): the teacher's guided velocity (MSE), + optional hidden-state KD."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option
from wandistiller.recipe.losses.base import LAST, LossInputs, Needs, hidden_mse, velocity_mse


@dataclass
class DistillationConfig:
    _target_: str = "wandistiller.recipe.losses.distillation.Distillation"
    _partial_: bool = True
    # Weight of the MSE between the student's last block (through a learned projection to the teacher's width)
    # and the teacher's; 0 = off (the teacher then returns no hidden states and the student builds no projection).
    hidden_kd_weight: float = 0.0


class Distillation:
    """The teacher's guided velocity (MSE), plus hidden-state MSE weighted by `hidden_kd_weight`."""

    def __init__(self, hidden_kd_weight: float = DistillationConfig.hidden_kd_weight):
        if not (math.isfinite(hidden_kd_weight) and hidden_kd_weight >= 0):
            raise UserError(f"trainer.loss.hidden_kd_weight={hidden_kd_weight} must be 0 or more and finite; 0 is off")
        self.hidden_kd_weight = hidden_kd_weight
        hidden = LAST if hidden_kd_weight > 0 else ()
        self.needs = Needs(teacher=True, teacher_hidden=hidden, student_hidden=hidden)

    def __call__(self, inputs: LossInputs) -> dict[str, torch.Tensor]:
        velocity = velocity_mse(inputs)
        hidden = hidden_mse(inputs) if self.needs.teacher_hidden else torch.zeros((), device=inputs.pred.device)
        return {"loss": velocity + self.hidden_kd_weight * hidden, "velocity": velocity, "hidden": hidden}


OPTION = Option("distillation", DistillationConfig, Distillation)
