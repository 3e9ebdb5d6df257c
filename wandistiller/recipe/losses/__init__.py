"""Training losses (`trainer.loss`), one module per option of `conf/loss/` (distillation, task, blend, features;
`base.py` holds the interface: `LossInputs`, `Needs`, named parts). Each module declares
`OPTION = Option("<name>", <its schema>, <its class>)`; `REGISTRY` finds it.

- `distillation` (default): the teacher's guided velocity, + optional hidden-state KD;
- `task`: the same student without the teacher: the denoising velocity noise - x0 of the data's latents;
- `blend`: alpha * task + (1 - alpha) * distillation (torchtune's `kd_ratio`, BK-SDM's task + KD);
- `features`: the velocity + feature KD at several depths (BK-SDM's feature KD), one part per (teacher block,
  student block) pair. Its pairs depend on the student's depth and keep-map, so it has `resolve(teacher_blocks,
  student_blocks, kept)`, which the recipe calls once the student is built (and preflight on the JSON, to refuse
  blocks the models lack); a loss whose `needs` are fixed needs none.

Adding a loss: one module here (its schema dataclass with `_target_` and `_partial_: true`, its class with
`needs`, its `OPTION`) and one YAML `conf/loss/<name>.yaml` (`# @package trainer.loss`, `defaults:
[/schema/loss/<name>@_here_, _self_]`, its keys); no other edit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

from wandistiller.core.registry import Registry
from wandistiller.recipe.losses.base import NEEDS, Legacy, Loss, LossInputs, Needs, logged, total
from wandistiller.recipe.losses.distillation import Distillation

REGISTRY = Registry("loss", __name__, "a loss")


def as_loss(fn: Callable | None) -> Loss:
    """The loss the loop calls, with `needs` a Needs: a loss as it is, a Legacy-shaped function wrapped (given the
    hidden states when its bound `hidden_kd_weight` is above 0), None the default.

    `trainer.loss` is instantiated `_partial_`, so a user's Legacy-shaped function gets its keys
    bound; a partial of a loss class (the options here) is built here with its keys.
    """
    if fn is None:
        return Distillation()
    loss: Any = fn() if isinstance(fn, functools.partial) and isinstance(fn.func, type) else fn
    declared = getattr(loss, "needs", None)
    if isinstance(declared, (Needs, frozenset, set)):
        loss.needs = Needs.of(declared)
        return cast(Loss, loss)
    weight = loss.keywords.get("hidden_kd_weight", 0.0) if isinstance(loss, functools.partial) else 0.0
    return Legacy(loss, weight > 0)


__all__ = ["NEEDS", "REGISTRY", "Loss", "LossInputs", "Needs", "as_loss", "logged", "total"]
