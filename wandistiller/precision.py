"""Precision: dtype strings converted once, and checked against the hardware before anything loads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wandistiller.errors import UserError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def to_dtype(name: str, key: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"{key}={name!r} is not a dtype; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class Precision:
    name: str
    teacher_dtype: torch.dtype
    student_dtype: torch.dtype
    autocast_dtype: torch.dtype | None

    @classmethod
    def from_config(cls, cfg) -> Precision:
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
