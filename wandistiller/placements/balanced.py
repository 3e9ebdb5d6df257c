"""`teacher_placement=balanced`: one teacher per node spread evenly over the node's GPUs by accelerate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wandistiller.core.registry import Option
from wandistiller.placements.device_map import DeviceMapPlacement
from wandistiller.placements.memory import Hardware


@dataclass
class BalancedConfig:
    _target_: str = "wandistiller.placements.balanced.BalancedPlacement"
    max_memory: Any = None  # per-GPU caps, e.g. {0: 30GiB, 1: 30GiB}
    debug_cpu: bool = False


class BalancedPlacement(DeviceMapPlacement):
    name, speed_rank, auto_candidate = "balanced", 20, True

    def __init__(self, max_memory: Any = BalancedConfig.max_memory, debug_cpu: bool = BalancedConfig.debug_cpu):
        super().__init__("balanced", max_memory, debug_cpu)

    def note(self, hw: Hardware) -> str:
        return f"one teacher per node spread over {len(hw.gpu_bytes)} GPU(s)"


OPTION = Option("balanced", BalancedConfig, BalancedPlacement)
