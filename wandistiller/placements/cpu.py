"""`teacher_placement=cpu`: one teacher per node in host RAM, computing on the CPU, serving the node's ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option
from wandistiller.placements.base import Placement, Serving, load_teacher
from wandistiller.placements.memory import Estimate, Hardware, Workload, host_training_bytes, student_device_bytes
from wandistiller.placements.memory import teacher_weight_bytes as weights


@dataclass
class CpuConfig:
    _target_: str = "wandistiller.placements.cpu.CpuPlacement"


class CpuPlacement(Placement):
    name, speed_rank, serving, fp8 = "cpu", 70, Serving.NODE_OWNER, True
    whole_on_one_device = backprop = teacher_on_cpu = True

    def check(self, precision, world) -> None:
        if precision.teacher_dtype == torch.float16:
            raise UserError("teacher_placement=cpu cannot run an fp16 teacher; use precision=bf16 or precision=fp32")

    def estimate(self, w: Workload, hw: Hardware) -> Estimate:
        gpus = (student_device_bytes(w),) * min(len(hw.gpu_bytes), w.ranks_per_node)
        # The owner holds the teacher and runs its forward; every rank is a process (without a GPU, a student).
        others = (w.ranks_per_node - 1) * host_training_bytes(w, hw, teacher_here=False)
        host = weights(w) + host_training_bytes(w, hw) + others
        return Estimate.of(self.name, gpus, host, hw, "one teacher per node in host RAM, computing on the CPU")

    def teacher_device(self, topology) -> torch.device:
        return torch.device("cpu")

    def load(self, spec, teacher_cfg, precision, topology):
        return load_teacher(spec, teacher_cfg, precision.teacher_dtype, self.teacher_device(topology))


OPTION = Option("cpu", CpuConfig, CpuPlacement)
