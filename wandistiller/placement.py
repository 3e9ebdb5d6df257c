"""Teacher placements: where the teacher's weights live and who runs it.

One small class per placement behind one interface, each named by `_target_` in
`conf/teacher_placement/<name>.yaml`:

    check(precision)        refuse early, before any weights load or download, with one line naming a fix
    load(spec, teacher_cfg, precision) -> Teacher
"""

from __future__ import annotations

import os

import torch

from wandistiller.errors import UserError
from wandistiller.precision import Precision
from wandistiller.teacher import Teacher, TeacherSpec, load_expert


def guidance_scales(spec: TeacherSpec, teacher_cfg) -> list[float]:
    """The CFG scale per expert; the low-noise expert falls back to the main scale, as WanPipeline does."""
    scales = [teacher_cfg.guidance_scale]
    if len(spec.experts) == 2:
        scale_2 = teacher_cfg.guidance_scale_2
        scales.append(teacher_cfg.guidance_scale if scale_2 is None else scale_2)
    return scales


def load_teacher(spec: TeacherSpec, teacher_cfg, dtype: torch.dtype, device: torch.device, **load_kwargs) -> Teacher:
    experts = [load_expert(spec, name, dtype, **load_kwargs).to(device) for name in spec.experts]
    return Teacher(spec, experts, guidance_scales(spec, teacher_cfg), device)


class CpuPlacement:
    """Weights in CPU RAM, computing on the CPU (the old --teacher_on_cpu)."""

    name = "cpu"

    def __init__(self, device_index: int | None = None):
        self.device = torch.device("cpu")

    def check(self, precision: Precision) -> None:
        if precision.teacher_dtype == torch.float16:
            raise UserError("teacher_placement=cpu cannot run an fp16 teacher; use precision=bf16 or precision=fp32")

    def load(self, spec: TeacherSpec, teacher_cfg, precision: Precision) -> Teacher:
        return load_teacher(spec, teacher_cfg, precision.teacher_dtype, self.device)


class GpuPlacement:
    """A full teacher on this process's own GPU; loaded straight onto it, not staged in host RAM."""

    name = "gpu"

    def __init__(self, device_index: int | None = None):
        self.device_index = int(os.environ.get("LOCAL_RANK", 0)) if device_index is None else device_index
        self.device = torch.device("cuda", self.device_index)

    def check(self, precision: Precision) -> None:
        if not torch.cuda.is_available():
            raise UserError("teacher_placement=gpu needs a CUDA GPU and none is visible; use teacher_placement=cpu")
        if self.device_index >= torch.cuda.device_count():
            raise UserError(
                f"teacher_placement.device_index={self.device_index} but only {torch.cuda.device_count()} GPU(s) "
                "are visible; pick one of them or leave it null"
            )

    def load(self, spec: TeacherSpec, teacher_cfg, precision: Precision) -> Teacher:
        return load_teacher(spec, teacher_cfg, precision.teacher_dtype, self.device, device_map=str(self.device))
