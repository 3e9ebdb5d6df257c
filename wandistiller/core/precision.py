"""Precision: dtype strings converted once, and checked against the hardware before anything loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

from wandistiller.core.errors import UserError

M = TypeVar("M", bound=torch.nn.Module)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def to_dtype(name: str, key: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"{key}={name!r} is not a dtype; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def auto_choice(planned_gpus: int | None = None) -> str:
    """precision=auto: bf16 where the run has GPUs, fp32 elsewhere (bf16 has no fast CPU kernels here: the
    default run measured 2-3x fewer samples/s in bf16 than fp32 on a 2-core x86 VM). `planned_gpus`: the GPUs
    of hardware planned on paper (`hardware.gpus`), which a plan for them must use rather than this machine's
    (a CPU-only laptop planned a 14B teacher for 8 GPUs at fp32); None = CUDA visible here."""
    if planned_gpus is not None:
        return "bf16" if planned_gpus > 0 else "fp32"
    return "bf16" if torch.cuda.is_available() else "fp32"


def cast_keeping_fp32(model: M, dtype: torch.dtype) -> M:
    """`model` in `dtype` as diffusers' `from_pretrained(torch_dtype=...)` leaves it: the modules a diffusers
    model lists in `_keep_in_fp32_modules` (Wan's norms, time embedder, rope) stay fp32. A plain `.to(dtype)`
    casts them too (and warns), so a student would sample unlike it trained."""
    keep = set()
    for module in model.modules():
        keep |= set(getattr(module, "_keep_in_fp32_modules", None) or ())
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and not keep & set(name.split(".")):
                tensor.data = tensor.data.to(dtype)
    return model


@dataclass(frozen=True)
class Precision:
    name: str
    teacher_dtype: torch.dtype
    student_dtype: torch.dtype
    autocast_dtype: torch.dtype | None

    @classmethod
    def from_config(cls, cfg) -> Precision:
        """A concrete precision option's node (precision=auto is resolved first: core.hydra.resolve_precision)."""
        if cfg.name == "auto":
            raise ValueError("precision=auto: resolve it first (wandistiller.core.hydra.auto_precision)")
        return cls(
            name=cfg.name,
            teacher_dtype=to_dtype(cfg.teacher_dtype, "precision.teacher_dtype"),
            student_dtype=to_dtype(cfg.student_dtype, "precision.student_dtype"),
            autocast_dtype=None
            if cfg.autocast_dtype is None
            else to_dtype(cfg.autocast_dtype, "precision.autocast_dtype"),
        )

    @property
    def needs_grad_scaler(self) -> bool:
        return self.autocast_dtype == torch.float16

    def check(self, student_device: torch.device) -> None:
        """fp16 is a GPU format here: CPU autocast has no fp16 path worth using and no grad scaler."""
        if torch.float16 in (self.teacher_dtype, self.autocast_dtype) and student_device.type != "cuda":
            raise UserError(
                f"precision={self.name} needs a CUDA GPU and none is visible; use precision=bf16 or precision=fp32"
            )
