"""Teacher placements: one module per option of `conf/teacher_placement/`, each holding its config schema
and its class (see `base.Placement` for the interface). This registry is the one list of them: the
planner asks each for its estimate, and the config store gives each option its own schema.

Adding a placement: one module here (a `...Config` dataclass and a `Placement` subclass), one YAML in
`conf/teacher_placement/` (`defaults: [/schema/teacher_placement/<name>@_here_, _self_]`), one line in
OPTIONS, and it is tested by tests/placements/test_init.py, which is parametrised over every YAML.
"""

from __future__ import annotations

from wandistiller.placements.auto import AutoConfig, AutoPlacement
from wandistiller.placements.balanced import BalancedConfig, BalancedPlacement
from wandistiller.placements.base import Placement, Serving
from wandistiller.placements.cpu import CpuConfig, CpuPlacement
from wandistiller.placements.device_map import DeviceMapConfig, DeviceMapPlacement
from wandistiller.placements.disk import DiskConfig, DiskPlacement
from wandistiller.placements.gpu import GpuConfig, GpuPlacement
from wandistiller.placements.gpu0 import Gpu0Config, Gpu0Placement
from wandistiller.placements.offload import OffloadConfig, OffloadPlacement
from wandistiller.placements.sequential import SequentialConfig, SequentialPlacement
from wandistiller.placements.sharded import ShardedConfig, ShardedPlacement

# option name -> (config schema, placement class)
OPTIONS: dict[str, tuple[type, type]] = {
    "gpu": (GpuConfig, GpuPlacement),
    "gpu0": (Gpu0Config, Gpu0Placement),
    "balanced": (BalancedConfig, BalancedPlacement),
    "sequential": (SequentialConfig, SequentialPlacement),
    "device_map": (DeviceMapConfig, DeviceMapPlacement),
    "sharded": (ShardedConfig, ShardedPlacement),
    "offload": (OffloadConfig, OffloadPlacement),
    "disk": (DiskConfig, DiskPlacement),
    "cpu": (CpuConfig, CpuPlacement),
    "auto": (AutoConfig, AutoPlacement),
}


def planner_candidates() -> list[Placement]:
    """One instance (default settings) of every placement `auto` may choose."""
    return [cls() for _, cls in OPTIONS.values() if issubclass(cls, Placement) and cls.auto_candidate]


def names_where(capable) -> list[str]:
    """The options whose placement class has a capability (`lambda cls: cls.fp8`): for refusals that name them."""
    return [name for name, (_, cls) in OPTIONS.items() if issubclass(cls, Placement) and capable(cls)]


def register_schemas(store) -> None:
    for name, (schema, _) in OPTIONS.items():
        store.store(group="schema/teacher_placement", name=name, node=schema)


__all__ = ["OPTIONS", "Placement", "Serving", "names_where", "planner_candidates", "register_schemas"]
