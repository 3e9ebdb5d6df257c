"""Teacher placements: one module per option of `conf/teacher_placement/`, each declaring
`OPTION = Option(name, its config schema, its class)` (see `base.Placement` for the interface). `REGISTRY`
finds them: the planner asks each for its estimate, and the config store gives each option its own schema.

Adding a placement: one module here (a `...Config` dataclass, a `Placement` subclass and its `OPTION`) and one
YAML in `conf/teacher_placement/` (`defaults: [/schema/teacher_placement/<name>@_here_, _self_]`); no other edit.
tests/placements/test_init.py is parametrised over every YAML.
"""

from __future__ import annotations

from typing import cast

from wandistiller.core.registry import Registry
from wandistiller.placements.base import Placement, Serving

REGISTRY = Registry("teacher_placement", __name__, "a teacher placement")


def planner_candidates() -> list[Placement]:
    """One instance (default settings) of every placement `auto` may choose."""
    return [cls() for cls in REGISTRY.classes() if issubclass(cls, Placement) and cls.auto_candidate]


def names_where(capable) -> list[str]:
    """The options whose placement class has a capability (`lambda cls: cls.fp8`): for refusals that name them."""
    names = REGISTRY.where(lambda cls: issubclass(cls, Placement) and capable(cls))
    return sorted(names, key=lambda name: cast(type[Placement], REGISTRY.get(name).cls).speed_rank)  # the fastest first


__all__ = ["REGISTRY", "Placement", "Serving", "names_where", "planner_candidates"]
