"""The frozen Wan teacher at run time: its experts loaded and frozen, regionally compiled, and computing guided
velocity targets (`Teacher`). What the folder holds and how it is checked: teacher/spec.py.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from safetensors import safe_open
from torch import nn
from torch.utils.hooks import RemovableHandle

from wandistiller.teacher.finetune import apply as apply_loras
from wandistiller.teacher.image import TEXT_TOKENS, ImageCondition, doubled, expert_inputs
from wandistiller.teacher.spec import TeacherSpec, loading

if TYPE_CHECKING:
    from diffusers import ModelMixin


def freeze(model: nn.Module) -> nn.Module:
    """The one place a teacher module becomes a frozen teacher: eval, no grads, nothing left on meta."""
    model.eval().requires_grad_(False)
    on_meta = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if on_meta:
        raise RuntimeError(f"teacher tensors left on the meta device after loading: {on_meta[:5]}")
    return model


def load_expert(spec: TeacherSpec, name: str, dtype: torch.dtype, **load_kwargs) -> nn.Module:
    """Expert `name` of the teacher, frozen, with the spec's LoRAs (teacher.lora) merged into its weights."""
    from diffusers import WanTransformer3DModel

    with loading(spec, name):
        model = WanTransformer3DModel.from_pretrained(
            spec.path, subfolder=name, dtype=dtype, use_safetensors=True, **load_kwargs
        )
    apply_loras(model, name, spec.loras)  # a fine-tuned teacher (teacher.lora): merged once, in float32
    return freeze(model)


STORED = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def save_finetuned_expert(spec: TeacherSpec, name: str, folder: Path) -> None:
    """Expert `name` with the spec's LoRAs (teacher.lora) merged, saved as a diffusers model folder in the dtype its
    block weights are stored in: a fine-tuned teacher's transformer where a pipeline needs one (a LoRA student's)."""
    first = sorted((spec.path / name).glob("*.safetensors"))[0]
    with safe_open(first, "pt") as f:
        kinds = [f.get_slice(k).get_dtype() for k in f.keys() if k.startswith("blocks.") and k.endswith(".weight")]
    dtype = STORED.get(kinds[0] if kinds else "F32", torch.float32)
    cast("ModelMixin", load_expert(spec, name, dtype)).save_pretrained(folder, safe_serialization=True)


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """A Wan transformer's blocks (nn.Module's attribute access is typed Tensor | Module)."""
    return cast(nn.ModuleList, model.blocks)


def compile_blocks(expert: nn.Module, backend: str = "inductor") -> None:
    """Regional torch.compile: one graph for the block, reused by all 40 (as diffusers' compile_repeated_blocks).

    Only each block's `forward` is compiled, not its whole call (which compile_repeated_blocks takes), so
    hooks on a block stay eager: the streamers swap weights in them between calls, which a graph could not.
    Weights are graph inputs, so swapping them does not recompile; outputs equal the resident compiled ones.
    Every adaptable layer gets its (empty) adapter hook first (teacher/lora.py `make_room`): a block traced before
    adapters are made (a teacher that samples before its LoRA student exists) would otherwise never see them, as
    dynamo does not guard on hooks added later; with the hook traced, a new adapter set fails a guard and recompiles.
    `backend`: torch.compile's (tests trace with "eager": dynamo's graphs and guards without inductor's builds).
    """
    from wandistiller.teacher.lora import make_room  # noqa: PLC0415 -- cycle: lora's fp8 imports this module

    make_room(expert)
    # One graph per state the blocks run in, for every block: grad on or off, an adapter set on or none (teacher/
    # lora.py), the first block's input needing a gradient or not, a new batch shape. A LoRA dmd step meets ~10, over
    # dynamo's default of 8 per function, past which the blocks would fall back to eager, silently.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    for block in blocks_of(expert):
        block.forward = torch.compile(block.forward, fullgraph=True, backend=backend)
    log_first_call(blocks_of(expert)[0], "the teacher's block graph")


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile's default backend (inductor) cannot compile for `device` here, or None where it can:
    dynamo unsupported (this Python or platform), no triton for a GPU, no C++ compiler for the CPU."""
    try:
        torch._dynamo.eval_frame.check_if_dynamo_supported()
    except Exception as e:  # its own message says what is missing
        return f"torch.compile is not supported here ({e})"
    if device.type == "cuda":
        from torch.utils._triton import has_triton  # noqa: PLC0415 -- only a GPU's compile needs it

        return None if has_triton() else "its GPU backend needs triton (missing, or a GPU older than sm_70)"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler  # noqa: PLC0415 -- only where compiling

        cxx = get_cpp_compiler()
    except Exception:  # inductor's message names its config, not what to do
        return "its CPU backend finds no working C++ compiler (install g++, or set CXX to one)"
    return None if shutil.which(cxx) else f"its CPU backend needs a C++ compiler ({cxx}: not on PATH)"


def log_first_call(module: nn.Module, what: str) -> None:
    """One log line when `module`'s first call starts (torch.compile compiles then, lazily) and one with how
    long that call took: a compile takes from seconds to minutes, and a silent wait looks like a hang."""

    log, started = logging.getLogger("wandistiller"), []

    def before(m, args, kwargs=None):
        log.info("compiling %s (torch.compile, on its first call)", what)
        started.append(time.perf_counter())
        pre.remove()

    def after(m, args, out):
        log.info("compiled %s in %.1f s (its first call, compute included)", what, time.perf_counter() - started[0])
        post.remove()

    pre, post = module.register_forward_pre_hook(before), module.register_forward_hook(after)


def guidance_scales(spec: TeacherSpec, teacher_cfg) -> list[float]:
    """The CFG scale per expert; the low-noise expert falls back to the main scale, as WanPipeline does."""
    scales = [teacher_cfg.guidance_scale]
    if len(spec.experts) == 2:
        scale_2 = teacher_cfg.guidance_scale_2
        scales.append(teacher_cfg.guidance_scale if scale_2 is None else scale_2)
    return scales


class Teacher:
    """Guided-velocity targets from one or two frozen Wan experts.

    Mirrors WanPipeline's denoising step: for two experts, `transformer` serves t >= boundary and
    `transformer_2` the rest (timestep space, not index space); CFG is uncond + g * (cond - uncond)
    with the expert's own scale. Cond and uncond run as one batch of 2B.
    """

    def __init__(self, spec: TeacherSpec, experts: list[nn.Module], guidance_scales: list[float], device: torch.device):
        if len(experts) != len(guidance_scales):
            raise ValueError("one guidance scale per expert")
        self.spec = spec
        self.experts = experts
        self.guidance_scales = guidance_scales
        self.device = device
        self.dtype = cast(torch.dtype, experts[0].dtype)  # ModelMixin.dtype skips the modules diffusers keeps in fp32
        # Sharded experts' forwards are collectives: every rank runs every expert, even without samples for it.
        self.collective = False
        self.streamers: list = []  # set by the streaming placements (offload, disk)
        self.patch = spec.transformer_config.get("patch_size") or (1, 2, 2)

    def copy_ms(self) -> float | None:
        """Time spent streaming weights since the last call; None for a teacher that does not stream."""
        return sum(s.drain_copy_ms() for s in self.streamers) if self.streamers else None

    def expert_index(self, t: torch.Tensor) -> torch.Tensor:
        """0 for `transformer` (t >= boundary, the high-noise expert), 1 for `transformer_2`."""
        if len(self.experts) == 1:
            return torch.zeros_like(t, dtype=torch.long)
        boundary = self.spec.boundary_timestep
        assert boundary is not None  # two experts: a boundary between them
        return (t < boundary).long()

    @torch.no_grad()
    def targets(
        self,
        x_t: torch.Tensor,
        t: torch.Tensor,
        cond: torch.Tensor,
        uncond: torch.Tensor,
        layers: tuple[int, ...] = (),
        image: ImageCondition | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Guided velocity (float32, on the teacher's device) and, for `layers` (block indices), the cond hidden
        states after those blocks from the same forward, stacked: (len(layers), batch, tokens, width).

        An image-to-video teacher takes `image` (teacher/image.py), fed as its own pipeline feeds it; cond and
        uncond share it, as they do in the pipeline."""
        # Latents stay float32 until combined with the image's (TI2V mixes them in float32, then casts, as its
        # pipeline does); a text-to-video teacher casts them at once.
        x_t, t = x_t.to(self.device, torch.float32), t.to(self.device)
        cond, uncond = cond.to(self.device, self.dtype), uncond.to(self.device, self.dtype)
        if image is not None and image.embeds is not None and cond.shape[1] != TEXT_TOKENS:
            raise ValueError(f"image tokens need text padded to {TEXT_TOKENS} tokens (diffusers splits them so)")
        which = self.expert_index(t)
        out = torch.empty(x_t.shape, dtype=torch.float32, device=self.device)
        hidden = None
        for i, (expert, scale) in enumerate(zip(self.experts, self.guidance_scales)):
            # One expert serves every row: no nonzero(), which would make the host wait for the device.
            rows = slice(None) if len(self.experts) == 1 else (which == i).nonzero().flatten()
            count = len(t) if isinstance(rows, slice) else rows.numel()  # a slice: one expert
            if count == 0:
                if self.collective:  # keep step with the other ranks: one sample's forward, thrown away
                    first = None if image is None else image.select(slice(0, 1))
                    inputs = expert_inputs(self.spec.layout, self.patch, x_t[:1], t[:1], first, self.dtype)
                    expert(**inputs, encoder_hidden_states=cond[:1], return_dict=False)
                continue
            if count < len(t):  # group the samples each expert serves, as one batch per expert
                xs, ts, cs, us = x_t[rows], t[rows], cond[rows], uncond[rows]
                served = None if image is None else image.select(rows)
            else:
                xs, ts, cs, us, served = x_t, t, cond, uncond, image
            inputs = doubled(expert_inputs(self.spec.layout, self.patch, xs, ts, served, self.dtype))
            with capture_blocks(expert, layers) as captured:
                pred = expert(**inputs, encoder_hidden_states=torch.cat([cs, us]), return_dict=False)[0]
            # (to this device: a model spread over GPUs returns from its last one)
            pred_cond, pred_uncond = pred.to(self.device, torch.float32).chunk(2)
            out[rows] = pred_uncond + scale * (pred_cond - pred_uncond)
            if layers:
                h = torch.stack([c[:count] for c in captured]).to(self.device, torch.float32)
                hidden = h.new_empty((len(layers), len(t), *h.shape[2:])) if hidden is None else hidden
                hidden[:, rows] = h
        return out, hidden


class capture_blocks:
    """Context manager: forward hooks that keep the outputs of the blocks at `layers` (block indices, in that
    order) of one forward; no hook at all for no layers."""

    def __init__(self, model: nn.Module, layers: tuple[int, ...]):
        self.model, self.layers = model, tuple(layers)
        self.handles: list[RemovableHandle] = []

    def __enter__(self) -> list[torch.Tensor]:
        captured: list = [None] * len(self.layers)
        for i, layer in enumerate(self.layers):
            keep = lambda m, inputs, out, i=i: captured.__setitem__(i, out)
            self.handles.append(blocks_of(self.model)[layer].register_forward_hook(keep))
        return captured

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
