"""`teacher_placement=sequential`: one teacher per node filling GPU 0 first, then GPU 1, … (accelerate)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wandistiller.core.registry import Option
from wandistiller.placements.device_map import DeviceMapPlacement, sequential_shares
from wandistiller.placements.memory import Hardware, Workload


@dataclass
class SequentialConfig:
    _target_: str = "wandistiller.placements.sequential.SequentialPlacement"
    max_memory: Any = None
    debug_cpu: bool = False


class SequentialPlacement(DeviceMapPlacement):
    name, speed_rank, auto_candidate = "sequential", 30, True

    def __init__(self, max_memory: Any = SequentialConfig.max_memory, debug_cpu: bool = SequentialConfig.debug_cpu):
        super().__init__("sequential", max_memory, debug_cpu)

    def shares(self, w: Workload, hw: Hardware) -> list[int]:
        return sequential_shares(w, hw)

    def student_gpus(self, w: Workload, hw: Hardware) -> int:
        return len(hw.gpu_bytes)  # planned as if every GPU it fills also trains

    def note(self, hw: Hardware) -> str:
        return "fills GPU 0 first"


OPTION = Option("sequential", SequentialConfig, SequentialPlacement)
