"""`method=kd` (default): today's distillation step. The batch is the data's (a pure function of seed, step,
micro-batch and rank), the teacher's target at it, and `trainer.loss` (`loss=distillation|task|blend`) the loss;
the student samples as the teacher does (`method.steps` null)."""

from __future__ import annotations

from dataclasses import dataclass

from wandistiller.core.registry import Option
from wandistiller.recipe.loop import distill_step
from wandistiller.recipe.methods.base import Method


@dataclass
class KdConfig:
    _target_: str = "wandistiller.recipe.methods.kd.KD"
    name: str = "kd"
    # Steps of the student's own schedule; null: it samples with the teacher's scheduler and steps.
    steps: int | None = None


class KD(Method):
    """One micro-batch: the data's batch, the teacher's target where the loss needs it, `trainer.loss`."""

    name = "kd"

    def student_loss(self, run, step, micro, clock):
        batch = run.batch_fn(step, micro, run.dp_rank).to(run.device)
        return distill_step(run, step, micro, batch, clock)


OPTION = Option("kd", KdConfig, KD)
