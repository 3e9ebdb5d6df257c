"""`loss=dummy`: the teacher's guided velocity (MSE), scaled by `trainer.loss.scale`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wandistiller.core.registry import Option
from wandistiller.recipe.losses.base import LossInputs, Needs, velocity_mse


@dataclass
class DummyLossConfig:
    _target_: str = "dummyplugin.loss.dummy.DummyLoss"
    _partial_: bool = True
    scale: float = 1.0


class DummyLoss:
    def __init__(self, *, scale: float):
        self.scale = scale
        self.needs = Needs(teacher=True)

    def __call__(self, inputs: LossInputs) -> dict[str, torch.Tensor]:
        velocity = velocity_mse(inputs)
        return {"loss": self.scale * velocity, "velocity": velocity}


OPTION = Option("dummy", DummyLossConfig, DummyLoss)
