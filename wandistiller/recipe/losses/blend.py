"""`loss=blend`: alpha * task + (1 - alpha) * distillation (torchtune's `kd_ratio`, BK-SDM's task + KD)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option
from wandistiller.recipe.losses.base import LossInputs, task_mse
from wandistiller.recipe.losses.distillation import Distillation


@dataclass
class BlendConfig:
    _target_: str = "wandistiller.recipe.losses.blend.Blend"
    _partial_: bool = True
    alpha: float = 0.5  # the task loss's weight in [0, 1]
    hidden_kd_weight: float = 0.0  # as loss=distillation's


class Blend:
    """alpha * task + (1 - alpha) * distillation; parts logged unweighted (`loss_task`, `loss_velocity`)."""

    def __init__(self, alpha: float = BlendConfig.alpha, hidden_kd_weight: float = BlendConfig.hidden_kd_weight):
        if not 0.0 <= alpha <= 1.0:
            raise UserError(f"trainer.loss.alpha={alpha} is outside [0, 1]; give a weight of the task loss in [0, 1]")
        self.alpha, self.kd = alpha, Distillation(hidden_kd_weight)
        self.needs = dataclasses.replace(self.kd.needs, x0=True)

    def __call__(self, inputs: LossInputs) -> dict[str, torch.Tensor]:
        kd, task = self.kd(inputs), task_mse(inputs)
        return {"loss": self.alpha * task + (1 - self.alpha) * kd["loss"], "task": task} | {
            k: v for k, v in kd.items() if k != "loss"
        }


OPTION = Option("blend", BlendConfig, Blend)
