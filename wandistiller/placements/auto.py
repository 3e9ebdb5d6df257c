"""`teacher_placement=auto`: the planner's choice, resolved before anything loads.

`wandistiller.job.preflight.choose_placement` asks every registered placement for its estimate, takes
the fastest that fits (by the planner's step time: placements/planner.py's fastest_first) and composes
`teacher_placement=<choice>` through Hydra, so the chosen option's schema, defaults and interpolations
(e.g. `disk`'s `${paths.cache_dir}`) apply as if it had been named.
"""

from __future__ import annotations

from dataclasses import dataclass

from wandistiller.core.registry import Option


@dataclass
class AutoConfig:
    _target_: str = "wandistiller.placements.auto.AutoPlacement"


class AutoPlacement:
    """A marker: never loads a teacher (preflight replaces it with the planner's choice)."""

    name = "auto"
    chosen_by_planner = True  # what preflight asks: the planner replaces this placement before anything loads


OPTION = Option("auto", AutoConfig, AutoPlacement)
