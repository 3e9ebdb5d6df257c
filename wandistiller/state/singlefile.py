"""A student as single `.safetensors` files in the Wan reference layout: what ComfyUI's "Load Diffusion Model"
and diffusers' `WanTransformer3DModel.from_single_file` read.

Keys are the Wan reference implementation's (`patch_embedding`, `text_embedding.0`, `blocks.3.self_attn.q`,
`blocks.3.norm3`, `head.head`, ...): `wan_key` is the exact inverse of diffusers' own
`convert_wan_transformer_to_diffusers` (tests/state/test_singlefile.py converts every file back through it). The
tensors are the student's own, only renamed and cast: a diffusers model's blocks are one ModuleList, so they are
numbered without gaps.

fp8 (`--dtype fp8`) is written in ComfyUI's per-layer quantization layout (`fp8_layout="comfy_quant"`, read in
its source at commit 0411153ac63b: comfy/ops.py `_load_quantized_module`, comfy/quant_ops.py `QUANT_ALGOS` and
`TensorCoreFP8Layout`, comfy/utils.py `detect_layer_quantization`): each of the blocks' Linear weights in
float8_e4m3fn with `<layer>.weight_scale`, ONE float32 scalar for the whole tensor, and `<layer>.comfy_quant`, the
UTF-8 JSON `{"format": "float8_e4m3fn"}` as a uint8 tensor. One such key switches ComfyUI to its mixed-precision
ops, which read each layer by its own `.comfy_quant`: those dequantize as `fp8.to(compute dtype) x weight_scale`,
and every other tensor (biases, norms, embeddings, modulation, the head) loads in the compute dtype from the 16-bit
(or fp32) values stored here. The legacy layout (`fp8_layout="scaled_fp8"`, for ComfyUI builds older than
`.comfy_quant`): `<layer>.scale_weight` scalars and an empty `scaled_fp8` marker tensor (comfy/utils.py
`convert_old_quants`); ComfyUI then runs the whole model in fp8 storage, biases and the 16-bit layers included.
The weight is `fp8 x scale` in both. The project's own fp8 (teacher/fp8.py) keeps one scale per output row; the
file's scale is the largest of those row scales, by the same formula (amax / 448), so the row that sets it has the
same fp8 bytes in both (tested). Norms, embeddings, modulation and the head are never fp8. diffusers'
`from_single_file` reads neither layout right (it loads the fp8 weights and drops their scales, with a warning
only): the fp8 file is for ComfyUI.

Loaders that guess a Wan model's shape from its weights (ComfyUI's model detection) take the head count as the
width / 128, one FFN width from block 0, patch (1, 2, 2), a 256-wide time embedding and 4096-wide text features;
`loader_assumptions_broken` says which of these a student breaks (diffusers with `config=` needs none of them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

import torch

from wandistiller.teacher.fp8 import E4M3_MAX, TINY

E4M3 = torch.float8_e4m3fn
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": E4M3}
FP8_LAYOUTS = ("comfy_quant", "scaled_fp8")  # ComfyUI's per-layer quantization; its legacy whole-model scaled fp8
# `<layer>.comfy_quant`: the layer's quantization config, UTF-8 JSON as uint8 (ComfyUI's ops json.loads its bytes).
COMFY_QUANT_FP8 = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
SCALED_FP8 = "scaled_fp8"  # ComfyUI's marker: a file whose `.scale_weight` tensors scale its fp8 weights

# diffusers name (a regular expression on the whole key) -> the Wan reference name; `\1`, `\2` keep the block index
# and the parameter ("weight", "bias"). Every key of a WanTransformer3DModel (text- or image-to-video) matches exactly
# one.
_WAN_NAMES = [
    (r"patch_embedding\.(\w+)", r"patch_embedding.\1"),
    (r"condition_embedder\.text_embedder\.linear_1\.(\w+)", r"text_embedding.0.\1"),
    (r"condition_embedder\.text_embedder\.linear_2\.(\w+)", r"text_embedding.2.\1"),
    (r"condition_embedder\.time_embedder\.linear_1\.(\w+)", r"time_embedding.0.\1"),
    (r"condition_embedder\.time_embedder\.linear_2\.(\w+)", r"time_embedding.2.\1"),
    (r"condition_embedder\.time_proj\.(\w+)", r"time_projection.1.\1"),
    (r"blocks\.(\d+)\.attn1\.to_(q|k|v)\.(\w+)", r"blocks.\1.self_attn.\2.\3"),
    (r"blocks\.(\d+)\.attn1\.to_out\.0\.(\w+)", r"blocks.\1.self_attn.o.\2"),
    (r"blocks\.(\d+)\.attn1\.norm_(q|k)\.(\w+)", r"blocks.\1.self_attn.norm_\2.\3"),
    (r"blocks\.(\d+)\.attn2\.to_(q|k|v)\.(\w+)", r"blocks.\1.cross_attn.\2.\3"),
    (r"blocks\.(\d+)\.attn2\.to_out\.0\.(\w+)", r"blocks.\1.cross_attn.o.\2"),
    (r"blocks\.(\d+)\.attn2\.norm_(q|k)\.(\w+)", r"blocks.\1.cross_attn.norm_\2.\3"),
    # Wan 2.1 I2V's CLIP image tokens: their projection, and each block's cross-attention keys and values of them
    # (the names diffusers' own single-file converter reads back: single_file_utils' TRANSFORMER_KEYS_RENAME_DICT).
    (r"blocks\.(\d+)\.attn2\.add_(k|v)_proj\.(\w+)", r"blocks.\1.cross_attn.\2_img.\3"),
    (r"blocks\.(\d+)\.attn2\.norm_added_k\.(\w+)", r"blocks.\1.cross_attn.norm_k_img.\2"),
    (r"condition_embedder\.image_embedder\.norm1\.(\w+)", r"img_emb.proj.0.\1"),
    (r"condition_embedder\.image_embedder\.ff\.net\.0\.proj\.(\w+)", r"img_emb.proj.1.\1"),
    (r"condition_embedder\.image_embedder\.ff\.net\.2\.(\w+)", r"img_emb.proj.3.\1"),
    (r"condition_embedder\.image_embedder\.norm2\.(\w+)", r"img_emb.proj.4.\1"),
    (r"blocks\.(\d+)\.norm2\.(\w+)", r"blocks.\1.norm3.\2"),  # the cross-attention norm: Wan calls it norm3
    (r"blocks\.(\d+)\.ffn\.net\.0\.proj\.(\w+)", r"blocks.\1.ffn.0.\2"),
    (r"blocks\.(\d+)\.ffn\.net\.2\.(\w+)", r"blocks.\1.ffn.2.\2"),
    (r"blocks\.(\d+)\.scale_shift_table", r"blocks.\1.modulation"),
    (r"scale_shift_table", r"head.modulation"),
    (r"proj_out\.(\w+)", r"head.head.\1"),
]
_COMPILED = [(re.compile(pattern), wan) for pattern, wan in _WAN_NAMES]
# The Linear weights inside the blocks (Wan names): the ones fp8 stores, as teacher/fp8.py's `eligible` picks.
FP8_WEIGHT = re.compile(r"blocks\.\d+\.(?:self_attn\.[qkvo]|cross_attn\.[qkvo]|ffn\.[02])\.weight")


def wan_key(name: str) -> str:
    """The Wan reference name of a WanTransformer3DModel state-dict key (ValueError for one it does not have: a
    key of another model (FLF2V's image position embedding, VACE's blocks) is never written under a made-up name)."""
    for pattern, wan in _COMPILED:
        if pattern.fullmatch(name):
            return pattern.sub(wan, name)
    raise ValueError(f"{name!r} has no name in the Wan reference layout")


def _keeps_fp32(model, name: str) -> bool:
    """Whether diffusers keeps this tensor fp32 in a bf16/fp16 model (`_keep_in_fp32_modules`: the norms, the time
    embedder, the modulation tables), as `from_pretrained(torch_dtype=...)` and core/precision.py do."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return bool(keep & set(name.split(".")))


def quantize_tensorwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, 0-dim float32 scale) with weight ~= fp8 * scale: ComfyUI's one scale per tensor, by the formula
    of teacher/fp8.py's `quantize_weight` (amax / 448, never below its TINY) over the whole tensor."""

    w = weight.detach().float()
    scale = (w.abs().amax() / E4M3_MAX).clamp(min=TINY)
    return (w / scale).to(E4M3), scale.reshape(())


def wan_tensors(model, dtype: str, fp8_layout: str = "comfy_quant") -> dict[str, torch.Tensor]:
    """The model's tensors under their Wan names, in `dtype` (bf16, fp16, fp32; fp8: the blocks' Linear weights
    in float8 with their scales in `fp8_layout`, the rest bf16), diffusers' fp32 modules kept fp32 below fp32."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if fp8_layout not in FP8_LAYOUTS:
        raise ValueError(f"fp8 layout {fp8_layout!r} is not one of {FP8_LAYOUTS}")
    legacy = fp8_layout == "scaled_fp8"
    wide = torch.bfloat16 if dtype == "fp8" else DTYPES[dtype]
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        key, tensor = wan_key(name), tensor.detach()
        if dtype == "fp8" and FP8_WEIGHT.fullmatch(key):
            layer = key.removesuffix("weight")
            out[key], out[layer + ("scale_weight" if legacy else "weight_scale")] = quantize_tensorwise(tensor)
            if not legacy:
                out[layer + "comfy_quant"] = COMFY_QUANT_FP8.clone()
        else:
            keep = tensor.dtype == torch.float32 and _keeps_fp32(model, name)
            out[key] = tensor.to(torch.float32 if keep else wide).contiguous()
    if dtype == "fp8" and legacy:
        out[SCALED_FP8] = torch.empty(0, dtype=E4M3)
    return out


def block_count_problem(keys: Iterable[str]) -> str | None:
    """Blocks numbered 0..n-1 without a gap (loaders count blocks until the first missing index), else what is
    wrong."""
    found = sorted({int(k.split(".")[1]) for k in keys if k.startswith("blocks.")})
    return None if found == list(range(len(found))) else f"blocks numbered {found}, not 0..{len(found) - 1}"


def dequantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An fp8 file's tensors (either layout) as the reference recipe reads them (weight x scale, in float32), the
    scales, `.comfy_quant` entries and the marker dropped."""
    out = {}
    for key, tensor in tensors.items():
        if key == SCALED_FP8 or key.endswith((".scale_weight", ".weight_scale", ".comfy_quant")):
            continue
        layer = key.removesuffix("weight")
        scale = tensors.get(layer + "weight_scale", tensors.get(layer + "scale_weight"))
        out[key] = tensor.float() * scale if scale is not None and key.endswith(".weight") else tensor.float()
    return out


# What a loader that guesses the shape from the weights assumes of a Wan model (ComfyUI's model detection), with
# the diffusers config value it reads it from.
ASSUMED = {"attention_head_dim": 128, "patch_size": [1, 2, 2], "freq_dim": 256, "text_dim": 4096}


def loader_assumptions_broken(config: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Each guess of ASSUMED that this student's shape breaks (`attention_head_dim=16, not 128`), and FFN widths
    that differ between blocks; empty where a guessing loader builds it right."""
    broken = [
        f"{k}={_plain(config.get(k))}, not {_plain(v)}"
        for k, v in ASSUMED.items()
        if _plain(config.get(k)) != _plain(v)
    ]
    widths = {t.shape[0] for k, t in tensors.items() if re.fullmatch(r"blocks\.\d+\.ffn\.0\.weight", k)}
    if len(widths) > 1:
        broken.append(f"FFN widths {sorted(widths)} differ between blocks")
    return broken


def _plain(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def metadata(config: dict, sampling: dict, teacher: dict, expert: dict | None = None) -> dict[str, str]:
    """The file's `__metadata__` (strings only, as safetensors requires): the student's diffusers config (what
    `from_single_file(config=...)` needs), its sampling, the teacher it came from and, for one expert of a pair,
    which one and the boundary between them."""
    meta = {
        "format": "pt",
        "wandistiller.layout": "wan",
        "config": json.dumps(config, sort_keys=True),
        "sampling": json.dumps(sampling, sort_keys=True),
        "teacher": json.dumps(teacher, sort_keys=True),
    }
    if expert is not None:
        meta["expert"] = json.dumps(expert, sort_keys=True)
    return meta


def config_of(model) -> dict:
    """The model's diffusers config as config.json holds it, without diffusers' bookkeeping (where it was
    loaded from: a path of this machine)."""
    return {k: _plain(v) for k, v in dict(model.config).items() if not k.startswith("_")}


def expert_names(name: str, count: int) -> list[str]:
    """The files' names: `<name>.safetensors` for one expert; Wan 2.2 A14B's pair `<name>_high_noise` (the first
    expert, `transformer`, serving t at or above the boundary) and `<name>_low_noise` (`transformer_2`)."""
    if count == 1:
        return [f"{name}.safetensors"]
    if count == 2:
        return [f"{name}_high_noise.safetensors", f"{name}_low_noise.safetensors"]
    raise ValueError(f"{count} experts: a student has one, or Wan 2.2 A14B's two")


def file_bytes(model, dtype: str) -> int:
    """The single file's size from the model's shapes alone (its tensors may be on the meta device: a 14B
    student's is counted without building it), header excluded."""
    total = 0
    for name, tensor in model.state_dict().items():
        key = wan_key(name)
        if dtype == "fp8" and FP8_WEIGHT.fullmatch(key):
            total += tensor.numel() + 4 + COMFY_QUANT_FP8.numel()  # a byte a weight, a float32 scale, its config
        else:
            keep = tensor.dtype == torch.float32 and _keeps_fp32(model, name)
            width = 2 if dtype == "fp8" else DTYPES[dtype].itemsize
            total += tensor.numel() * (4 if keep else width)
    return total
