"""The interface of every training loss (`trainer.loss`): what one micro-batch gives it (`LossInputs`), what it
declares it needs (`Needs`), and how its named parts become the step's loss and its metrics.

A loss is called with one `LossInputs` and returns `dict[str, Tensor]` of scalar parts. The loop logs every
part as `loss_<name>` and trains on the key `"loss"` when the loss gives one (its parts are then shown
unweighted, as they are, e.g. the hidden-state MSE before its weight), else on the sum of the parts.

Its `needs` alone decides what a step computes: the teacher's guided velocity (`teacher`), the teacher's hidden
states after given blocks paired with the student's (`teacher_hidden`/`student_hidden`: the student then builds
one learned projection to the teacher's width per pair), and the clean latents the batch was made from (`x0`).
A loss without the teacher lets a rank that holds its own teacher skip it. A new loss (a few-step method's parts)
is a module declaring its `Needs`; the loop, the served teacher and the student follow. A loss whose blocks depend
on the student's depth and keep-map (loss=features) sets its `needs` in `resolve`, called once the student is built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F

# The names a loss may declare as a frozenset instead of a Needs; "teacher_hidden" means the last block of each.
NEEDS = frozenset({"teacher", "teacher_hidden", "x0"})
LAST = (-1,)


@dataclass(frozen=True)
class Needs:
    """What the loop computes for a loss, and nothing more."""

    teacher: bool = False  # the teacher's guided velocity
    # Teacher blocks whose (cond) output the loss matches, each paired with the student block at the same place in
    # `student_hidden` (negative indices count from the last block).
    teacher_hidden: tuple[int, ...] = ()
    student_hidden: tuple[int, ...] = ()
    x0: bool = False  # the clean latents and the noise x_t was mixed from

    def __post_init__(self) -> None:
        if len(self.teacher_hidden) != len(self.student_hidden):
            raise ValueError("Needs: teacher_hidden and student_hidden pair up, one student block per teacher block")

    @property
    def teacher_runs(self) -> bool:
        return self.teacher or bool(self.teacher_hidden)

    @classmethod
    def of(cls, declared: Needs | Iterable[str]) -> Needs:
        """A loss's `needs` as a Needs: as it is, or from a frozenset of NEEDS' names."""
        if isinstance(declared, Needs):
            return declared
        names = frozenset(declared)
        unknown = names - NEEDS
        if unknown:
            raise ValueError(f"a loss needs {sorted(unknown)}; a loss may need {sorted(NEEDS)} (or a Needs)")
        hidden = LAST if "teacher_hidden" in names else ()
        return cls(teacher="teacher" in names, teacher_hidden=hidden, student_hidden=hidden, x0="x0" in names)


@dataclass
class LossInputs:
    """What one micro-batch gives a loss; what it did not declare in `needs` is None."""

    pred: torch.Tensor  # the student's velocity
    # One per pair of `needs.student_hidden`: the student block's output through its projection to the teacher's width.
    student_hidden: tuple[torch.Tensor, ...] | None
    target: torch.Tensor | None  # the teacher's guided velocity ("teacher")
    teacher_hidden: tuple[torch.Tensor, ...] | None  # one per block of `needs.teacher_hidden`
    x0: torch.Tensor | None  # the clean latents ("x0")
    noise: torch.Tensor | None  # the noise x_t was mixed from ("x0")
    t: torch.Tensor  # timesteps in [0, num_train_timesteps)


def velocity_mse(inputs: LossInputs) -> torch.Tensor:
    assert inputs.target is not None, "velocity_mse needs the teacher's target (needs.teacher)"
    return F.mse_loss(inputs.pred.float(), inputs.target.float())


def hidden_mse(inputs: LossInputs, pair: int = 0) -> torch.Tensor:
    """MSE between the student's projected hidden states and the teacher's, for one pair of blocks."""
    assert inputs.student_hidden is not None and inputs.teacher_hidden is not None, "needs.teacher_hidden"
    student, teacher = inputs.student_hidden[pair], inputs.teacher_hidden[pair]
    return F.mse_loss(student.float(), teacher.to(inputs.pred.device).float())


def task_mse(inputs: LossInputs) -> torch.Tensor:
    """Rectified flow's own target: x_t = (1-s) x0 + s noise, so the velocity is noise - x0."""
    assert inputs.noise is not None and inputs.x0 is not None, "task_mse needs the batch's x0 and noise (needs.x0)"
    velocity = (inputs.noise - inputs.x0).to(inputs.pred.device, torch.float32)
    return F.mse_loss(inputs.pred.float(), velocity)


class Loss(Protocol):
    """What the loop calls: a loss with its `needs` (what `as_loss` makes of `trainer.loss`)."""

    needs: Needs

    def __call__(self, inputs: LossInputs) -> dict[str, torch.Tensor]: ...


class Legacy:
    """A user's loss function (pred, target, student_hidden, teacher_hidden) -> (loss, velocity, hidden),
    given the last blocks' hidden states when `hidden_kd_weight` (its bound key) is above 0. Compatibility with
    losses written for this project's pre-release interface: removed in 0.2 (docs/ARCHITECTURE.md)."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]], want_hidden: bool):
        self.fn = fn
        self.needs = Needs(
            teacher=True, teacher_hidden=LAST if want_hidden else (), student_hidden=LAST if want_hidden else ()
        )

    def __call__(self, inputs: LossInputs) -> dict[str, torch.Tensor]:
        def first(hidden: tuple[torch.Tensor, ...] | None) -> torch.Tensor | None:
            return hidden[0] if hidden else None

        loss, velocity, hidden = self.fn(
            inputs.pred, inputs.target, first(inputs.student_hidden), first(inputs.teacher_hidden)
        )
        return {"loss": loss, "velocity": velocity, "hidden": hidden}


def total(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the step backpropagates: the "loss" part when given, else the sum of the parts."""
    return parts["loss"] if "loss" in parts else cast(torch.Tensor, sum(parts.values()))


def logged(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parts as metrics, detached: `loss` and `loss_<name>` for each named part."""
    return {"loss": total(parts).detach()} | {f"loss_{k}": v.detach() for k, v in parts.items() if k != "loss"}
