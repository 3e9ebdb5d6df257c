"""How WanDistiller calls each `_target_` a user may swap, so that one with the wrong signature is one line
naming the key before anything loads, not a TypeError from deep inside setup.

Each entry is what the call site passes besides the keys under the node: positional placeholders (their
names, for the message) and keyword names. Keep it in step with the call sites it names.
"""

from __future__ import annotations

import inspect

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from wandistiller.core.errors import UserError

# keys whose `_target_` may instead be a class built from the keys alone (its instances are what is called)
LOSS_CLASSES = frozenset({"trainer.loss"})
HYDRA_KEYS = frozenset({"_target_", "_partial_", "_args_", "_recursive_", "_convert_"})

# key -> (positional arguments, keyword arguments) the project adds at its call site
CALLS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "recipe": (("cfg", "prepared", "topology"), ()),  # job/run.py run_recipe
    "student": ((), ("spec", "dtype")),  # recipe._setup_student
    # loop.distill_step, for a Legacy-shaped function; a loss class (an option of recipe.losses.REGISTRY) is built
    # from its keys alone and its instances called with LossInputs (LOSS_CLASSES below)
    "trainer.loss": (("pred", "target", "student_hidden", "teacher_hidden"), ()),
    "trainer.optimizer": (("params",), ()),  # recipe._setup_optimization
    "logger.*": ((), ()),  # each logger: tracking.loggers.build
    "hooks.*": ((), ()),  # each hook: recipe.hooks.build
    "teacher_placement": ((), ()),  # preflight.choose_placement
}


def check_signatures(cfg: DictConfig) -> None:
    """Every swappable target accepts what its call site passes (the keys under it included)."""

    calls = [(k, c) for k, c in CALLS.items() if not k.endswith(".*")]
    for key, call in CALLS.items():  # "logger.*": every entry under the node
        if key.endswith(".*") and isinstance(node := OmegaConf.select(cfg, key[:-2]), DictConfig):
            calls += [(f"{key[:-2]}.{name!s}", call) for name in node.keys()]
    for key, (positional, keywords) in calls:
        node = OmegaConf.select(cfg, key)
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        try:
            target = get_object(node._target_)
            signature = inspect.signature(target)
        except (ValueError, TypeError):  # a builtin without a signature: nothing to check against
            continue
        if key in LOSS_CLASSES and inspect.isclass(target):
            positional = ()
        given = [str(k) for k in node.keys() if k not in HYDRA_KEYS]
        args = [None] * (len(node.get("_args_") or []) + len(positional))
        try:
            signature.bind(*args, **dict.fromkeys([*given, *keywords]))
        except TypeError as e:
            called = ", ".join([*positional, *(f"{k}=" for k in [*given, *keywords])])
            raise UserError(
                f"{key}._target_={node._target_!r} cannot be called as WanDistiller calls it ({called}): {e}; "
                f"give it that signature, or fix the keys under {key}"
            ) from None
