"""`method=dummy`: the kd step with its loss scaled by `method.weight`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option
from wandistiller.recipe.loop import Clock, Run, distill_step
from wandistiller.recipe.methods.base import Method


@dataclass
class DummyConfig:
    _target_: str = "dummyplugin.method.dummy.Dummy"
    name: str = "dummy"
    steps: int | None = None
    weight: float = 1.0


class Dummy(Method):
    name = "dummy"
    card_phrase = "the student transformer learned the teacher's velocity, scaled (guidance scale {g})"

    def __init__(self, *, name: str, steps: int | None, weight: float):
        if weight <= 0:
            raise UserError(f"method.weight={weight} must be positive; e.g. method.weight=0.5")
        super().__init__(name, steps)
        self.weight = weight

    def student_loss(
        self, run: Run, step: int, micro: int, clock: Clock
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], tuple[object, object] | None]:
        batch = run.batch_fn(step, micro, run.dp_rank).to(run.device)
        loss, parts, span = distill_step(run, step, micro, batch, clock)
        return loss * self.weight, parts | {"dummy_weight": torch.tensor(self.weight)}, span


OPTION = Option("dummy", DummyConfig, Dummy)
