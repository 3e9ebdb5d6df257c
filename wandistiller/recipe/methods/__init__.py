"""Training methods (`method=`): what one training step does, one module per option of `conf/method/` (`base.Method`
is the interface). Each module declares `OPTION = Option("<name>", <its schema>, <its class>)`; `REGISTRY` finds it.

- `kd` (default): plain distillation, the teacher's target at the data's batch, `trainer.loss` choosing
  the loss (distillation, task, blend);
- `trajectory`: a K-step student (`method.steps`) learns to jump between points of the teacher's guided ODE,
  sampled once from fixed noises and cached;
- `dmd`: distribution matching (DMD2): the student generates in K steps, the teacher's guided score and an
  online fake score, trained on the student's samples, give the generator's gradient.

Adding a method: one module here (its schema dataclass with `_target_`, `name` and `steps`, its `Method` subclass,
its `OPTION`) and one YAML `conf/method/<name>.yaml` (`defaults: [/schema/method/<name>@_here_, _self_]`); the
loop is not edited, nor the planner: a network it trains is declared in its `passes` (`OwnNetwork`).
"""

from __future__ import annotations

from typing import cast

from wandistiller.core.registry import Registry
from wandistiller.recipe.methods.base import Method, Network

REGISTRY = Registry("method", __name__, "a training method")


def card_phrases() -> dict[str, str]:
    """What the model card says each registered method taught its student (`Method.card_phrase`), by name: handed
    to state/card.py, which sits below the methods and names none of them."""
    return {name: cast(type[Method], REGISTRY.get(name).cls).card_phrase for name in REGISTRY.names()}


__all__ = ["REGISTRY", "Method", "Network", "card_phrases"]
