"""The opt-in fast paths, each checked before anything loads: an fp8 teacher, the teacher's attention
backend, and the student's torch.compile mode.

`teacher.quantize=fp8` swaps the teacher's transformer-block Linear layers for torchao's float8 dynamic
quantization (per-row scales for weights and activations): the matmuls run on the fp8 tensor cores of
Hopper and newer, at about twice the bf16 rate, and the weights take half the memory. The targets then
differ from bf16 ones by quantization error; `python -m wandistiller.bench job --quantize fp8` reports it.

Refused, with one line naming the key, where it cannot run: no CUDA device, a GPU without fp8, torchao
missing, or a streamed teacher (the streamers copy plain tensors, not torchao's subclasses).

`teacher.attention_backend=flash|_native_cudnn|...` picks diffusers' attention kernel for the teacher's
experts (diffusers' own check says whether it is installed). `trainer.compile_mode=reduce-overhead`
(CUDA graphs) or `max-autotune` is passed to the student's regional torch.compile.
"""

from __future__ import annotations

import torch
from torch import nn

from wandistiller.errors import UserError

MODES = ("fp8",)
FP8_CAPABILITY = (8, 9)  # Ada and Hopper (H100/H200) and newer have fp8 tensor cores
TORCHAO = "torchao==0.18.0"  # pyproject's [fp8] extra
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_quantize(mode: str | None, device: torch.device) -> None:
    """Refuse `teacher.quantize=MODE` before anything loads, where it cannot run on `device`."""
    if mode is None:
        return
    key = f"teacher.quantize={mode}"
    if mode not in MODES:
        raise UserError(f"{key} is unknown; use fp8 or null")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise UserError(f"{key} needs a CUDA GPU with fp8 (Hopper or newer) and the teacher runs on {device}")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise UserError(f"{key} needs a GPU with fp8 (Hopper or newer); {name} is sm_{capability[0]}{capability[1]}")
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise UserError(f"{key} needs torchao: pip install 'wandistiller[fp8]' ({TORCHAO})") from None


def quantize_teacher(teacher, mode: str | None) -> None:
    """Quantize every expert of a loaded, resident `Teacher` in place (after `check_quantize`)."""
    if mode is None:
        return
    if teacher.streamers:
        raise UserError(f"teacher.quantize={mode} works with resident teachers (cpu, gpu, gpu0), not streamed ones")
    for expert in teacher.experts:
        quantize_expert(expert, mode)


def quantize_expert(expert: nn.Module, mode: str) -> nn.Module:
    """fp8 dynamic quantization of the Linear layers inside the transformer blocks.

    Only the blocks: they hold ~99% of the FLOPs, while the embeddings, the time projection and the output
    head are small and precision-sensitive. Layers whose widths are not multiples of 16 stay in bf16
    (fp8 matmuls need that alignment).
    """
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    if mode not in MODES:
        raise ValueError(f"unknown quantize mode {mode!r}")

    def in_blocks(module: nn.Module, name: str) -> bool:
        return (
            isinstance(module, nn.Linear)
            and name.startswith("blocks.")
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )

    quantize_(expert, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), filter_fn=in_blocks)
    return expert


def check_compile_mode(mode: str | None, compile_student: bool) -> None:
    if mode is None:
        return
    if mode not in COMPILE_MODES:
        raise UserError(f"trainer.compile_mode={mode} is unknown; use one of {', '.join(COMPILE_MODES)} or null")
    if not compile_student:
        raise UserError(f"trainer.compile_mode={mode} applies to a compiled student; add trainer.compile_student=true")


def compile_kwargs(mode: str | None) -> dict:
    """torch.compile arguments for the student's regional compile."""
    return {"fullgraph": True} | ({"mode": mode} if mode else {})


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
