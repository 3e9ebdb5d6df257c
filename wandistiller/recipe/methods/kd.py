"""`method=kd` (default): plain distillation. The batch is the data's (a pure function of seed, step,
micro-batch and rank), the teacher's target at it, and `trainer.loss` (`loss=distillation|task|blend`) the loss;
the student samples as the teacher does (`method.steps` null)."""

from __future__ import annotations

from dataclasses import dataclass

from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option
from wandistiller.recipe.loop import distill_step
from wandistiller.recipe.methods.base import Method


@dataclass
class KdConfig:
    _target_: str = "wandistiller.recipe.methods.kd.KD"
    name: str = "kd"
    # Always null: a KD student samples with the teacher's scheduler and steps (a few-step student is trained as
    # one: method=trajectory|dmd); eval/generate --student-steps K sample it at K.
    steps: int | None = None


class KD(Method):
    """One micro-batch: the data's batch, the teacher's target where the loss needs it, `trainer.loss`."""

    name = "kd"
    card_phrase = (
        "the student transformer learned the teacher's classifier-free-guided velocity (guidance scale {g}) at "
        "noised latents of its training data (knowledge distillation)"
    )

    def __init__(self, *, name: str, steps: int | None):
        if steps is not None:  # it would be saved, and sampled, as a K-step student it was never trained to be
            raise UserError(
                f"method.steps={steps} with method=kd: a KD student learns the teacher's velocity and samples with "
                f"the teacher's scheduler; train a {steps}-step student with method=trajectory or method=dmd, or "
                f"sample this one at {steps} steps with eval/generate --student-steps {steps}"
            )
        super().__init__(name, steps)

    def student_loss(self, run, step, micro, clock):
        batch = run.batch_fn(step, micro, run.dp_rank).to(run.device)
        return distill_step(run, step, micro, batch, clock)


OPTION = Option("kd", KdConfig, KD)
