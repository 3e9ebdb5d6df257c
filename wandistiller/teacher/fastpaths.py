"""The teacher's opt-in fast paths, each checked before anything loads: an fp8 teacher and its attention backend.

`teacher.quantize=fp8` makes the Linear layers inside the teacher's blocks fp8 (`wandistiller.teacher.fp8`, the
project's own layer on `torch._scaled_mm`: per-row weight scales computed once at load, per-row
activation scales per call, bf16 output). The placement loads the teacher quantized (the bf16 teacher is
never in RAM); resident (cpu, gpu, gpu0) and streamed (offload, disk: half the bytes moved) alike. On
Hopper/Ada the matmuls run on fp8 tensor cores; on the CPU, `_scaled_mm` where this torch has it, else the
weights are widened per layer. The targets differ from bf16 ones by the quantization error
(`python -m wandistiller.bench teacher --quantize fp8` reports their relative MSE; held to <= 1%).

Refused, with one line naming the key, where it cannot run: a torch build without fp8 (`fp8.build_problem`), a GPU
without fp8, a teacher not computing
in bf16 (and a placement that cannot load it: `placements.base.check_quantize_placement`).

`teacher.attention_backend=flash|_native_cudnn|...` picks diffusers' attention kernel for the teacher's
experts (diffusers' own check says whether it is installed). The student's compile settings: student/compile.py.
"""

from __future__ import annotations

import torch
from torch import nn

from wandistiller.core.errors import UserError
from wandistiller.teacher.fp8 import build_problem, is_quantized, quantize_model

MODES = ("fp8",)
FP8_CAPABILITY = (8, 9)  # Ada and Hopper (H100/H200) and newer have fp8 tensor cores


def check_quantize_setting(mode: str | None, teacher_dtype: torch.dtype) -> None:
    """The setting alone, on any machine (a plan on paper, whose GPU this machine's cannot stand for)."""
    if mode is None:
        return
    key = f"teacher.quantize={mode}"
    if mode not in MODES:
        raise UserError(f"{key} is unknown; use fp8 or null")
    if teacher_dtype != torch.bfloat16:
        raise UserError(f"{key} computes with a bf16 teacher and this one is {teacher_dtype}; use precision=bf16")


def check_quantize(mode: str | None, device: torch.device, teacher_dtype: torch.dtype = torch.bfloat16) -> None:
    """Refuse `teacher.quantize=MODE` before anything loads, where it cannot run on `device`."""
    if mode is None:
        return
    key = f"teacher.quantize={mode}"
    check_quantize_setting(mode, teacher_dtype)
    if device.type != "cuda" or torch.cuda.is_available():  # (planning on paper: no GPU here to ask)
        problem = build_problem(str(device))
        if problem:
            raise UserError(f"{key} cannot run with this build: {problem}; drop teacher.quantize, or upgrade torch")
    if device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise UserError(
                f"{key} needs a GPU with fp8 (Ada, Hopper or newer); {name} is sm_{capability[0]}{capability[1]}: "
                "drop teacher.quantize"
            )


def quantize_teacher(teacher, mode: str | None) -> None:
    """Quantize every expert a placement loaded in bf16 (the placements load fp8 experts already quantized,
    so this changes nothing for them)."""
    if mode is None:
        return

    for expert in teacher.experts:
        if not is_quantized(expert):
            quantize_expert(expert, mode)


def quantize_expert(
    expert: nn.Module, mode: str, compute: str = "auto", device: torch.device | None = None, work_device=None
) -> nn.Module:
    """fp8 for the Linear layers inside the transformer blocks of a loaded, resident expert, in place;
    `device`: where it will compute, when not where it lies now."""

    if mode not in MODES:
        raise ValueError(f"unknown quantize mode {mode!r}")
    quantize_model(expert, compute, device, work_device)
    return expert


def check_attention_backend(backend: str | None) -> None:
    """A name diffusers has no attention backend of, refused before the teacher loads (it was said after, with
    diffusers' list of every backend in the line); a known one's package or kernel is tried as the teacher loads."""
    if backend is None:
        return
    from diffusers.models.attention_dispatch import AttentionBackendName

    if str(backend).lower() not in {b.value for b in AttentionBackendName}:  # diffusers lowercases it too
        raise UserError(
            f"teacher.attention_backend={backend} is not one of diffusers' attention backends; use e.g. flash, sage, "
            "_native_cudnn or native, or null for the default (the list: diffusers' AttentionBackendName)"
        )


def use_attention_backend(teacher, backend: str | None) -> None:
    """Every expert of `teacher` computes attention with diffusers' `backend` (None: leave the default)."""
    if backend is None:
        return
    for expert in teacher.experts:
        try:
            expert.set_attention_backend(backend)
        except Exception as e:  # unknown name, package missing, or the GPU lacks it: all the same to the user
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"teacher.attention_backend={backend} cannot be used here ({message})") from None
