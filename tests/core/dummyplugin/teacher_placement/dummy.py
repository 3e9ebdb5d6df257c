"""`teacher_placement=dummy`: each rank's own teacher on the CPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wandistiller.core.distributed import Topology
from wandistiller.core.precision import Precision
from wandistiller.core.registry import Option
from wandistiller.placements.base import Placement, load_teacher
from wandistiller.placements.memory import Estimate, Hardware, Workload, host_training_bytes, student_device_bytes
from wandistiller.placements.memory import teacher_weight_bytes as weights
from wandistiller.teacher.model import Teacher
from wandistiller.teacher.spec import TeacherSpec


@dataclass
class DummyPlacementConfig:
    _target_: str = "dummyplugin.teacher_placement.dummy.DummyPlacement"


class DummyPlacement(Placement):
    name, speed_rank = "dummy", 1

    def estimate(self, w: Workload, hw: Hardware) -> Estimate:
        gpus = (student_device_bytes(w),) * min(len(hw.gpu_bytes), w.ranks_per_node)
        host = w.ranks_per_node * (weights(w) + host_training_bytes(w, hw))
        return Estimate.of(self.name, gpus, host, hw, "a dummy: every rank's own teacher on the CPU")

    def teacher_device(self, topology: Topology) -> torch.device:
        return torch.device("cpu")

    def load(self, spec: TeacherSpec, teacher_cfg: object, precision: Precision, topology: Topology) -> Teacher:
        return load_teacher(spec, teacher_cfg, precision.teacher_dtype, self.teacher_device(topology))


OPTION = Option("dummy", DummyPlacementConfig, DummyPlacement)
