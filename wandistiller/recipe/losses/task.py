"""`loss=task`: the same student without the teacher: the denoising velocity noise - x0 of the data's latents."""

from __future__ import annotations

import torch

from wandistiller.recipe.losses.base import LossInputs, task_mse


class Task:
    """No teacher: the student learns to denoise the data's own latents (the baseline distilling must beat)."""

    needs = frozenset({"x0"})

    def __init__(self, hidden_kd_weight: float = 0.0):  # taken (and ignored) so every option shares the keys
        del hidden_kd_weight

    def __call__(self, inputs: LossInputs) -> dict[str, torch.Tensor]:
        return {"task": task_mse(inputs)}


LOSS = Task
