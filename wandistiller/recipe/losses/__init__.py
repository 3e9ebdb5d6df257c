"""Training losses (`trainer.loss`), one module per option of `conf/loss/` (distillation, task, blend;
`base.py` holds the interface: `LossInputs`, `needs`, named parts). A module defining `LOSS = <class>` is an
option, named by its module; `LOSSES` below is that registry (what an allow-list of `_target_`s may list).

- `distillation` (default): the teacher's guided velocity, + optional hidden-state KD;
- `task`: the same student without the teacher: the denoising velocity noise - x0 of the data's latents;
- `blend`: alpha * task + (1 - alpha) * distillation (torchtune's `kd_ratio`, BK-SDM's task + KD).

Adding a loss: one module here defining `LOSS` and one YAML `conf/loss/<name>.yaml` (`# @package trainer.loss`,
`_target_: wandistiller.recipe.losses.<name>.<Class>`, `_partial_: true`, its keys); no other edit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from wandistiller.core.extensions import modules_defining
from wandistiller.recipe.losses.base import NEEDS, Legacy, LossInputs, logged, total
from wandistiller.recipe.losses.blend import Blend
from wandistiller.recipe.losses.distillation import Distillation
from wandistiller.recipe.losses.task import Task


def options() -> dict[str, type]:
    """Option name (the module's, as `conf/loss/<name>.yaml` is) -> loss class, from every module defining LOSS."""
    return modules_defining(__name__, __path__, "LOSS")


LOSSES: dict[str, type] = options()


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
    return Legacy(fn, hidden_kd_weight > 0)


__all__ = ["LOSSES", "NEEDS", "Blend", "Distillation", "LossInputs", "Task", "as_loss", "logged", "options", "total"]
