"""`teacher_placement=gpu0`: the teacher on GPU 0 in a dedicated process; students train on GPUs 1..n.

The owner computes step k+1's targets while the students train step k. With `train_on_owner` the
owner trains too (on GPU 0, beside the teacher) and serves synchronously.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wandistiller.core.distributed import gpu_count
from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option
from wandistiller.placements.base import Placement, Serving, load_teacher
from wandistiller.placements.memory import (
    CUDA_CONTEXT,
    Estimate,
    Hardware,
    Workload,
    host_process_bytes,
    student_device_bytes,
)
from wandistiller.placements.memory import teacher_activation_bytes as activations
from wandistiller.placements.memory import teacher_weight_bytes as weights


@dataclass
class Gpu0Config:
    _target_: str = "wandistiller.placements.gpu0.Gpu0Placement"
    # The teacher's process also trains a student on GPU 0.
    train_on_owner: bool = False
    # Keep the process layout, put the teacher on the CPU (tests, dry runs).
    debug_cpu: bool = False


class Gpu0Placement(Placement):
    min_gpus = 2
    name, speed_rank, fp8 = "gpu0", 10, True
    serving = Serving.DEDICATED_OWNER  # its default; train_on_owner=true: NODE_OWNER

    def __init__(self, train_on_owner: bool = Gpu0Config.train_on_owner, debug_cpu: bool = Gpu0Config.debug_cpu):
        self.train_on_owner, self.debug_cpu = train_on_owner, debug_cpu
        self.serving = Serving.NODE_OWNER if train_on_owner else Serving.DEDICATED_OWNER

    def check(self, precision, world) -> None:
        # The GPUs first: without them no process count helps (a sweep's gpu0 point on a CPU machine
        # must say that, not ask for distributed.nproc_per_node).
        if not self.debug_cpu and gpu_count() < 2:
            other = "gpu" if gpu_count() == 1 else "cpu"
            raise UserError(
                f"teacher_placement=gpu0 needs 2 or more GPUs (teacher on GPU 0, students on 1..n) and this machine "
                f"has {gpu_count()}; use teacher_placement={other}"
            )
        if not self.train_on_owner and world.nproc_per_node < 2:  # preflight defaults it to one per GPU
            raise UserError(
                "teacher_placement=gpu0 runs the teacher in its own process: set distributed.nproc_per_node to "
                "1 + the number of student GPUs (or teacher_placement.train_on_owner=true)"
            )

    @staticmethod
    def default_ranks() -> int:
        """distributed.nproc_per_node when left at 1: the teacher on GPU 0 and a student on every other GPU."""
        return gpu_count()

    def estimate(self, w: Workload, hw: Hardware) -> Estimate:
        if len(hw.gpu_bytes) < 2:
            return Estimate.refused(self.name, "needs 2 or more GPUs")
        students = max(min(len(hw.gpu_bytes), w.ranks_per_node) - 1, 1)
        gpus = (weights(w) + activations(w) + CUDA_CONTEXT,) + (student_device_bytes(w),) * students
        note = f"teacher on GPU 0, {students} student rank(s) on GPUs 1..{students}"
        return Estimate.of(self.name, gpus, host_process_bytes(hw) * (students + 1), hw, note)

    def teacher_device(self, topology) -> torch.device:
        return torch.device("cpu") if self.debug_cpu else torch.device("cuda", 0)

    def load(self, spec, teacher_cfg, precision, topology):
        device = self.teacher_device(topology)
        kwargs = {} if self.debug_cpu else {"device_map": str(device)}
        return load_teacher(spec, teacher_cfg, precision.teacher_dtype, device, **kwargs)


OPTION = Option("gpu0", Gpu0Config, Gpu0Placement)
