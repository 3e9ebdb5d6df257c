"""`teacher_placement=gpu`: a full teacher on every rank's own GPU, loaded straight onto it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wandistiller.core.distributed import gpu_count, local_device
from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option
from wandistiller.placements.base import Placement, load_teacher
from wandistiller.placements.memory import Estimate, Hardware, Workload, beside_teacher_bytes, host_process_bytes
from wandistiller.placements.memory import teacher_weight_bytes as weights


@dataclass
class GpuConfig:
    _target_: str = "wandistiller.placements.gpu.GpuPlacement"


class GpuPlacement(Placement):
    min_gpus = 1
    name, speed_rank, fp8 = "gpu", 0, True
    whole_on_one_device = backprop = True

    def check(self, precision, world) -> None:
        if gpu_count() == 0:
            raise UserError("teacher_placement=gpu needs a CUDA GPU and none is visible; use teacher_placement=cpu")

    def estimate(self, w: Workload, hw: Hardware) -> Estimate:
        if not hw.gpu_bytes:
            return Estimate.refused(self.name, "needs a GPU")
        ranks = min(len(hw.gpu_bytes), w.ranks_per_node)
        gpus = (weights(w) + beside_teacher_bytes(w),) * ranks
        return Estimate.of(self.name, gpus, host_process_bytes(hw) * ranks, hw, "a full teacher on every rank's GPU")

    def teacher_device(self, topology) -> torch.device:
        return local_device(topology)

    def load(self, spec, teacher_cfg, precision, topology):
        device = self.teacher_device(topology)
        return load_teacher(spec, teacher_cfg, precision.teacher_dtype, device, device_map=str(device))


OPTION = Option("gpu", GpuConfig, GpuPlacement)
