"""`loss=task`: the same student without the teacher: the denoising velocity noise - x0 of the data's latents."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wandistiller.core.registry import Option
from wandistiller.recipe.losses.base import LossInputs, Needs, task_mse


@dataclass
class TaskConfig:
    _target_: str = "wandistiller.recipe.losses.task.Task"
    _partial_: bool = True


class Task:
    """No teacher: the student learns to denoise the data's own latents (the baseline distilling must beat)."""

    needs = Needs(x0=True)

    def __call__(self, inputs: LossInputs) -> dict[str, torch.Tensor]:
        return {"task": task_mse(inputs)}


OPTION = Option("task", TaskConfig, Task)
