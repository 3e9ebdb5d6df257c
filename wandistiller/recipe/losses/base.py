"""The interface of every training loss (`trainer.loss`): what one micro-batch gives it (`LossInputs`), what it
may declare it needs (`NEEDS`), and how its named parts become the step's loss and its metrics.

A loss is called with one `LossInputs` and returns `dict[str, Tensor]` of scalar parts. The loop logs
every part as `loss_<name>` and trains on the key `"loss"` when the loss gives one (its parts are then
shown unweighted, as they are, e.g. the hidden-state MSE before its weight), else on the sum of the parts.
`needs` says what the loop must compute for it: "teacher" (the guided velocity target), "teacher_hidden"
(the teacher's last hidden states) or "x0" (the clean latents and noise the batch was made from), so a
loss without "teacher" lets a rank that holds its own teacher skip it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NEEDS = frozenset({"teacher", "teacher_hidden", "x0"})


@dataclass
class LossInputs:
    """What one micro-batch gives a loss; what it did not declare in `needs` may be None."""

    pred: torch.Tensor  # the student's velocity
    student_hidden: torch.Tensor | None  # through the student's projection to the teacher's width
    target: torch.Tensor | None  # the teacher's guided velocity ("teacher")
    teacher_hidden: torch.Tensor | None  # ("teacher_hidden")
    x0: torch.Tensor | None  # the clean latents ("x0")
    noise: torch.Tensor | None  # the noise x_t was mixed from ("x0")
    t: torch.Tensor  # timesteps in [0, num_train_timesteps)


def velocity_mse(inputs: LossInputs) -> torch.Tensor:
    return F.mse_loss(inputs.pred.float(), inputs.target.float())


def hidden_mse(inputs: LossInputs, weight: float) -> torch.Tensor:
    if weight <= 0:
        return torch.zeros((), device=inputs.pred.device)
    return F.mse_loss(inputs.student_hidden.float(), inputs.teacher_hidden.to(inputs.pred.device).float())


def task_mse(inputs: LossInputs) -> torch.Tensor:
    """Rectified flow's own target: x_t = (1-s) x0 + s noise, so the velocity is noise - x0."""
    velocity = (inputs.noise - inputs.x0).to(inputs.pred.device, torch.float32)
    return F.mse_loss(inputs.pred.float(), velocity)


class Legacy:
    """A user's loss of the old shape: (pred, target, student_hidden, teacher_hidden) -> (loss, velocity, hidden)."""

    def __init__(self, fn: Callable, want_hidden: bool):
        self.fn = fn
        self.needs = frozenset({"teacher"} | ({"teacher_hidden"} if want_hidden else set()))

    def __call__(self, inputs: LossInputs) -> dict[str, torch.Tensor]:
        loss, velocity, hidden = self.fn(inputs.pred, inputs.target, inputs.student_hidden, inputs.teacher_hidden)
        return {"loss": loss, "velocity": velocity, "hidden": hidden}


def total(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the step backpropagates: the "loss" part when given, else the sum of the parts."""
    return parts["loss"] if "loss" in parts else sum(parts.values())


def logged(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parts as metrics, detached: `loss` and `loss_<name>` for each named part."""
    return {"loss": total(parts).detach()} | {f"loss_{k}": v.detach() for k, v in parts.items() if k != "loss"}
