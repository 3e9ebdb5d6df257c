"""`method=trajectory`: a K-step student (`method.steps`) learns to jump between points of the teacher's guided
ODE. The ODE is sampled once before training from fixed noises (`method.noises_per_prompt` per training prompt,
`method.teacher_steps` teacher steps, its own scheduler and guidance) and its states at the student's K + 1 sigmas
(teacher/fewstep.py) cached (data/trajectories.py). A micro-batch draws cached trajectories and one of the K
jumps each: from x(sigma_i) at timesteps[i], the student's velocity should be (x_{i+1} - x_i)/(sigma_{i+1} - sigma_i),
which takes it to x(sigma_{i+1}) in its own Euler step. Only the student trains; the teacher is not called
in the loop. The cheap rung, and `method=dmd`'s warm start: its jump loss as dmd's regression term
(`method.regression_weight`), or a trajectory run's student as dmd's starting point (`student.init=<run>/student`;
resuming a trajectory checkpoint with `method=dmd` is refused: a checkpoint resumes its own method).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wandistiller.core.registry import Option
from wandistiller.placements.steptime import Passes
from wandistiller.recipe.losses import logged, total
from wandistiller.recipe.methods.base import Method, steps_within
from wandistiller.recipe.methods.fewstep import FewStepConfig, OdePoints, positive, schedule_identity
from wandistiller.teacher.fewstep import parse_schedule


@dataclass
class TrajectoryConfig(FewStepConfig):
    _target_: str = "wandistiller.recipe.methods.trajectory.Trajectory"
    name: str = "trajectory"


class Trajectory(Method):
    """Only the student trains, on jumps between the teacher's cached ODE points."""

    name = "trajectory"
    card_phrase = (
        "the {k}-step student learned to jump between points of the teacher's classifier-free-guided sampling "
        "trajectories (guidance scale {g}), sampled once from fixed noises (trajectory distillation)"
    )
    teacher_in_loop = False
    uses_loss = False
    reads_x0 = False  # its x are the teacher's cached ODE points; the data gives its prompts
    samples_ode = True

    def __init__(
        self,
        *,
        name: str,
        steps: int,
        teacher_steps: int,
        noises_per_prompt: int,
        chunk: int,
        schedule: Any,
        shift: float | None,
    ):
        super().__init__(name, steps)
        self.k = steps_within(steps, teacher_steps)  # `steps`, checked: an int
        self.schedule = parse_schedule(schedule, shift, self.k)
        self.teacher_steps = teacher_steps
        self.per_prompt = positive("method.noises_per_prompt", noises_per_prompt)
        self.chunk = positive("method.chunk", chunk)

    def identity(self) -> dict:
        return super().identity() | schedule_identity(self.schedule)

    def passes(self, micro_batches: int, whole_step: bool) -> Passes:
        """The student's forward + backward alone: its teacher ODE is sampled once before training, not in a step."""
        return Passes(self.name, micro_batches, 0, 0.0, micro_batches)

    def prepare(self, ctx, teacher, embeddings, images=None) -> None:
        self.points = OdePoints(
            ctx, teacher, embeddings, self.k, self.teacher_steps, self.per_prompt, self.chunk, self.schedule, "", images
        )

    def student_loss(self, run, step, micro, clock):
        parts = {"trajectory": self.points.loss(run, step, micro)}
        mark = clock.mark()  # no teacher call: an empty span
        return total(parts), logged(parts), (mark, mark)


OPTION = Option("trajectory", TrajectoryConfig, Trajectory)
