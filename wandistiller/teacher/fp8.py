"""The project's own fp8 linear layer for the teacher, on `torch._scaled_mm` (no torchao).

Weights: float8_e4m3fn with one float32 scale per output row (per output channel), computed once when
the teacher loads. Activations: one scale per row (per token), computed on every call. Output in the
input's dtype (bf16), bias added after. Only the Linear layers inside the transformer blocks are
quantized: they hold ~99% of the FLOPs and bytes, while the embeddings, time projection and output head
are small and precision-sensitive.

Two ways to compute, fixed per layer when it is built (so a compiled graph sees no Python branch per
call): `scaled_mm` (fp8 x fp8 on Hopper/Ada tensor cores; on the CPU where the build has it: 2.13 does) and
`dequant` (the fp8 weight widened to bf16, then a bf16 matmul: any torch >= 2.1, any device, any shape).
`scaled_mm` is used where a probe call succeeds on the device and the layer's widths are multiples of 16
(cuBLASLt's fp8 alignment), else `dequant`.

One function (`quantize_weight`) makes the bytes for every path -- a resident teacher, the streamers'
host buffer and `disk`'s converted copy -- so streamed and resident fp8 targets are bit-identical.

An fp8 base trains adapters (`student=lora`, dmd's `method.fake_score=lora`: teacher/lora.py hooks them on these
layers as on nn.Linear ones): where the input needs a gradient, `FrozenFp8Matmul` passes one back to it, never to
the weight (QLoRA's scheme, at 8 bits). How close the adapters' gradients stay to a bf16 base's: docs/PERFORMANCE.md,
section "fp8".
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from wandistiller.teacher.model import blocks_of

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
TINY = 1e-12  # an all-zero row gets this scale instead of 0 (no division by zero, zeros stay zeros)
COMPUTES = ("auto", "scaled_mm", "dequant")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight [out, in], float32 scale [out, 1]) with weight ~= fp8 * scale, row by row."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=TINY)
    return (w / scale).to(E4M3), scale


def _rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations' per-row quantization (same arithmetic as the weights')."""
    x = x.float()
    scale = (x.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=TINY)
    return (x / scale).to(E4M3), scale


def build_problem(device: str, dtype_name: str = "float8_e4m3fn") -> str | None:
    """What this torch build lacks for an fp8 teacher on `device` (None: nothing): the float8 e4m3 dtype (torch
    < 2.1), or a cast to it there (the `dequant` path needs only those two; `_scaled_mm` is optional)."""
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        return f"torch {torch.__version__} has no {dtype_name} dtype (fp8 needs torch >= 2.1)"
    try:
        torch.ones(2, 2, device=device).to(dtype).to(torch.bfloat16)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        return f"torch {torch.__version__} cannot cast to {dtype_name} on {device} ({first})"
    return None


@functools.lru_cache(maxsize=8)
def scaled_mm_runs(device: str) -> bool:
    """Whether this torch runs a row-wise-scaled fp8 `_scaled_mm` on `device` (older CPU builds and pre-Ada
    GPUs do not; its signature changed over 2.x too). Probed once per device with a 16x32x16 call."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    try:
        a = torch.ones(16, 32, device=device).to(E4M3)
        b = torch.ones(16, 32, device=device).to(E4M3)
        out = torch._scaled_mm(
            a,
            b.t(),
            scale_a=torch.ones(16, 1, device=device),
            scale_b=torch.ones(1, 16, device=device),
            out_dtype=torch.bfloat16,
        )
        return bool(out.float().sum().item() == 16 * 16 * 32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def dequantized(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp8 weight widened to `dtype` (the `dequant` path's weight, and every path's backward)."""
    return weight.to(dtype) * weight_scale.to(dtype)


def fp8_matmul(
    rows: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, compute: str, fast_accum: bool
) -> torch.Tensor:
    """rows [n, in] @ W^T -> [n, out] in rows' dtype, W the fp8 weight with its per-row scales; no bias."""
    if compute == "scaled_mm":
        xq, x_scale = _rowwise(rows)
        return torch._scaled_mm(
            xq,
            weight.t(),
            scale_a=x_scale,
            scale_b=weight_scale.t(),
            out_dtype=rows.dtype,
            use_fast_accum=fast_accum,
        )  # weight.t(): column-major, as cuBLASLt wants the second operand
    return F.linear(rows, dequantized(weight, weight_scale, rows.dtype))


class FrozenFp8Matmul(torch.autograd.Function):
    """`fp8_matmul` with a backward to its input alone: the weight is frozen (buffers: never a weight gradient), so
    adapters on the layer (teacher/lora.py: a LoRA student, dmd's LoRA fake score) train through it.

    Forward: the layer's own arithmetic, so an adapted teacher with its adapters off gives the teacher's targets
    bit for bit. Backward: grad_x = grad_y @ dequantized(W), in grad_y's dtype (bf16) -- the exact derivative of
    the `dequant` path; for `scaled_mm` the activations' fp8 rounding is passed straight through (its derivative
    is zero almost everywhere), as fp8 training recipes do. Saved: the fp8 weight and its scales, which the layer
    holds anyway (no widened copy waits for the backward: autograd through `dequant`'s F.linear would keep a
    16-bit weight per layer, the whole teacher in 16 bits on a resident one); one layer is widened at a time in
    backward. `_scaled_mm` itself has no derivative in torch."""

    @staticmethod
    def forward(ctx, rows, weight, weight_scale, compute, fast_accum):
        ctx.save_for_backward(weight, weight_scale)
        return fp8_matmul(rows, weight, weight_scale, compute, fast_accum)

    @staticmethod
    def backward(ctx, grad):
        weight, weight_scale = ctx.saved_tensors
        return grad @ dequantized(weight, weight_scale, grad.dtype), None, None, None, None


class Fp8Linear(nn.Module):
    """y = x W^T + b with W stored as fp8 + per-row scales. `weight` and `weight_scale` are buffers (frozen,
    and the streamers swap buffers as they swap parameters); `bias` stays in the compute dtype."""

    weight: torch.Tensor  # buffers: declared for the checker (register_buffer makes them)
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        compute: str,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features, self.compute = in_features, out_features, compute
        # On a GPU, the fp8 tensor cores' fast accumulation (as torchao's inference configs): the error it adds
        # is far below the quantization's. Set by quantize_model for the device it will compute on.
        self.fast_accum = False
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=E4M3, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, 1, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute: str, work_device: torch.device | None = None) -> Fp8Linear:
        """The layer's fp8 twin, where the Linear lies; `work_device`: where to do the arithmetic (a GPU
        quantizes a 14B expert lying in host RAM in seconds, the CPU in minutes)."""
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, compute, w.device)
        if not w.is_meta:  # a skeleton's layer (meta) gets its bytes later, from the streamers' sources
            q, scale = quantize_weight(w.detach().to(work_device or w.device))
            layer.weight, layer.weight_scale = q.to(w.device), scale.to(w.device)
            if linear.bias is not None:
                layer.bias = linear.bias.detach().clone()
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        args = (self.weight, self.weight_scale, self.compute, self.fast_accum)
        if torch.is_grad_enabled() and rows.requires_grad:  # adapters train through it (teacher/lora.py)
            out = FrozenFp8Matmul.apply(rows, *args)
        else:  # targets, samples: no autograd node at all (and the graph a compiled teacher traces)
            out = fp8_matmul(rows, *args)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, compute={self.compute}"


def eligible(name: str, module: nn.Module) -> bool:
    """A Linear inside the transformer blocks (`name` relative to the model)."""
    return isinstance(module, nn.Linear) and name.startswith("blocks.")


def choose_compute(compute: str, device: torch.device, in_features: int, out_features: int) -> str:
    if compute not in COMPUTES:
        raise ValueError(f"unknown fp8 compute {compute!r}; one of {COMPUTES}")
    aligned = in_features % 16 == 0 and out_features % 16 == 0
    if compute == "dequant" or not aligned or not scaled_mm_runs(str(device)):
        return "dequant"
    return "scaled_mm"


def quantize_model(
    model: nn.Module, compute: str = "auto", device: torch.device | None = None, work_device: torch.device | None = None
) -> list[str]:
    """Replace every eligible Linear with an Fp8Linear in place; returns their names (relative to the model).

    Layer by layer, so the bf16 weights go as their fp8 copies come (the peak is the model plus one layer).
    `device`: where it will compute (a skeleton's layers are on meta; default: where each layer's weight is).
    """
    names = []
    for name, module in list(model.named_modules()):
        if not eligible(name, module):
            continue
        where = device if device is not None else module.weight.device
        how = choose_compute(compute, where, module.in_features, module.out_features)
        parent_name, _, leaf = name.rpartition(".")
        layer = Fp8Linear.from_linear(module, how, work_device)
        layer.fast_accum = torch.device(where).type == "cuda"
        setattr(model.get_submodule(parent_name), leaf, layer)
        names.append(name)
    return names


def block_fp8_layers(model: nn.Module) -> frozenset[str]:
    """The Fp8Linear layers of one block, by their names inside the block (`attn1.to_q`, `ffn.net.0.proj`)."""
    return frozenset(n for n, m in blocks_of(model)[0].named_modules() if isinstance(m, Fp8Linear))


def quantize_block_tensors(
    tensors: dict[str, torch.Tensor], layers: frozenset[str], work_device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """A block's tensors as read from its files (name -> bf16), with each fp8 layer's weight replaced by its
    fp8 bytes and `weight_scale` added (computed on `work_device`, returned where the tensor was); tensors
    already stored in fp8 pass through."""
    out = dict(tensors)
    for layer in layers:
        key = f"{layer}.weight"
        if key in out and out[key].dtype != E4M3:
            where = out[key].device
            q, scale = quantize_weight(out[key].to(work_device or where))
            out[key], out[f"{layer}.weight_scale"] = q.to(where), scale.to(where)
    return out


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Fp8Linear) for m in model.modules())


def relative_mse(output: torch.Tensor, reference: torch.Tensor) -> float:
    """mean((output - reference)^2) / mean(reference^2): the precision figure fp8 targets are held to (<= 1%)."""
    o, r = output.float(), reference.float()
    return float(((o - r) ** 2).mean() / (r**2).mean())


def fp8_layers_of(folder) -> frozenset[str]:
    """`block_fp8_layers` of the expert in `folder`, from its config.json alone (a skeleton on meta)."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    with init_empty_weights():
        model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(folder) | {"num_layers": 1})
    quantize_model(model, compute="dequant")
    return block_fp8_layers(model)
