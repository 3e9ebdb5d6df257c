"""Training losses (`trainer.loss`): each returns named parts and declares what it needs.

A loss is called with one `LossInputs` and returns `dict[str, Tensor]` of scalar parts. The loop logs
every part as `loss_<name>` and trains on the key `"loss"` when the loss gives one (its parts are then
shown unweighted, as they are, e.g. the hidden-state MSE before its weight), else on the sum of the parts.
`needs` says what the loop must compute for it: "teacher" (the guided velocity target), "teacher_hidden"
(the teacher's last hidden states) or "x0" (the clean latents and noise the batch was made from), so a
loss without "teacher" lets a rank that holds its own teacher skip it.

The options are in `LOSSES` (conf/trainer/loss/<name>.yaml names one each):
- `distillation` (default): the teacher's guided velocity, + optional hidden-state KD (today's loss);
- `task`: the same student without the teacher: the denoising velocity noise - x0 of the data's latents;
- `blend`: alpha * task + (1 - alpha) * distillation (torchtune's `kd_ratio`, BK-SDM's task + KD).
"""

from __future__ import annotations

import functools
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


def _velocity_mse(inputs: LossInputs) -> torch.Tensor:
    return F.mse_loss(inputs.pred.float(), inputs.target.float())


def _hidden_mse(inputs: LossInputs, weight: float) -> torch.Tensor:
    if weight <= 0:
        return torch.zeros((), device=inputs.pred.device)
    return F.mse_loss(inputs.student_hidden.float(), inputs.teacher_hidden.to(inputs.pred.device).float())


def _task_mse(inputs: LossInputs) -> torch.Tensor:
    """Rectified flow's own target: x_t = (1-s) x0 + s noise, so the velocity is noise - x0."""
    velocity = (inputs.noise - inputs.x0).to(inputs.pred.device, torch.float32)
    return F.mse_loss(inputs.pred.float(), velocity)


class Distillation:
    """The teacher's guided velocity (MSE), plus hidden-state MSE weighted by `hidden_kd_weight`."""

    def __init__(self, hidden_kd_weight: float = 0.0):
        self.hidden_kd_weight = hidden_kd_weight
        self.needs = frozenset({"teacher"} | ({"teacher_hidden"} if hidden_kd_weight > 0 else set()))

    def __call__(self, inputs: LossInputs) -> dict[str, torch.Tensor]:
        velocity, hidden = _velocity_mse(inputs), _hidden_mse(inputs, self.hidden_kd_weight)
        return {"loss": velocity + self.hidden_kd_weight * hidden, "velocity": velocity, "hidden": hidden}


class Task:
    """No teacher: the student learns to denoise the data's own latents (the baseline distilling must beat)."""

    needs = frozenset({"x0"})

    def __init__(self, hidden_kd_weight: float = 0.0):  # taken (and ignored) so every option shares the keys
        del hidden_kd_weight

    def __call__(self, inputs: LossInputs) -> dict[str, torch.Tensor]:
        return {"task": _task_mse(inputs)}


class Blend:
    """alpha * task + (1 - alpha) * distillation; parts logged unweighted (`loss_task`, `loss_velocity`)."""

    def __init__(self, alpha: float = 0.5, hidden_kd_weight: float = 0.0):
        if not 0.0 <= alpha <= 1.0:
            from wandistiller.core.errors import UserError

            raise UserError(f"trainer.loss.alpha={alpha} is outside [0, 1]; give a weight of the task loss in [0, 1]")
        self.alpha, self.kd = alpha, Distillation(hidden_kd_weight)
        self.needs = self.kd.needs | {"x0"}

    def __call__(self, inputs: LossInputs) -> dict[str, torch.Tensor]:
        kd, task = self.kd(inputs), _task_mse(inputs)
        return {"loss": self.alpha * task + (1 - self.alpha) * kd["loss"], "task": task} | {
            k: v for k, v in kd.items() if k != "loss"
        }


# The registry: option name -> class (what an allow-list of `_target_`s may list).
LOSSES: dict[str, type] = {"distillation": Distillation, "task": Task, "blend": Blend}


class _Legacy:
    """A user's loss of the old shape: (pred, target, student_hidden, teacher_hidden) -> (loss, velocity, hidden)."""

    def __init__(self, fn: Callable, want_hidden: bool):
        self.fn = fn
        self.needs = frozenset({"teacher"} | ({"teacher_hidden"} if want_hidden else set()))

    def __call__(self, inputs: LossInputs) -> dict[str, torch.Tensor]:
        loss, velocity, hidden = self.fn(inputs.pred, inputs.target, inputs.student_hidden, inputs.teacher_hidden)
        return {"loss": loss, "velocity": velocity, "hidden": hidden}


def as_loss(fn: Callable | None, hidden_kd_weight: float = 0.0):
    """The loss the loop calls: one with `needs` as it is, an old-shape function wrapped, None the default.

    `trainer.loss` is instantiated `_partial_`, so a user's function of the old shape still gets its keys
    bound; a partial of a loss class (the options here) is built here with its keys.
    """
    if fn is None:
        return Distillation(hidden_kd_weight)
    if isinstance(fn, functools.partial) and isinstance(fn.func, type):
        fn = fn()
    if isinstance(getattr(fn, "needs", None), frozenset):
        unknown = fn.needs - NEEDS
        if unknown:
            raise ValueError(f"loss {fn!r} needs {sorted(unknown)}; a loss may need {sorted(NEEDS)}")
        return fn
    return _Legacy(fn, hidden_kd_weight > 0)


def total(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the step backpropagates: the "loss" part when given, else the sum of the parts."""
    return parts["loss"] if "loss" in parts else sum(parts.values())


def logged(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parts as metrics, detached: `loss` and `loss_<name>` for each named part."""
    return {"loss": total(parts).detach()} | {f"loss_{k}": v.detach() for k, v in parts.items() if k != "loss"}
