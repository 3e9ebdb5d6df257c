"""A fine-tuned teacher: `teacher.lora`, LoRA files applied to the teacher before anything distils from it.

    teacher.lora=[/loras/style.safetensors]                                   # strength 1, every expert
    teacher.lora=[{path:/loras/style.safetensors,strength:0.8}]               # a strength of its own
    teacher.lora=[{path:/loras/a_high.safetensors,expert:transformer},{path:/loras/a_low.safetensors,expert:transformer_2}]

Each entry is a path (strength 1) or `{path, strength, expert}`; `expert` (a two-expert teacher: `transformer`, the
high-noise one, or `transformer_2`, the low-noise one, as diffusers names them and its `load_into_transformer_2`
loads them) is null for every expert: one file for both, as a Wan 2.1 LoRA is put on both experts of A14B, or a file
per expert, as Wan 2.2 LoRAs are published (`*_high_noise` / `*_low_noise`).

The layouts people have are read by diffusers' own converters (`WanPipeline.lora_state_dict`: Lightning/ComfyUI
`diffusion_model.blocks.N.self_attn.q.lora_down.weight` + `.alpha`, kohya/musubi `lora_unet_blocks_0_self_attn_q.
lora_down.weight`) or taken as they are (diffusers/peft `transformer.blocks.0.attn1.to_q.lora_A.weight`, with or
without the `transformer.` prefix, alpha from the `lora_adapter_metadata` diffusers writes, else alpha = rank).
Every file is read through core.files' guard, and checked against the teacher's own layers before the run folder is
made (their names and shapes, from a meta-device skeleton of its config: no weights): a file that is not a LoRA of
this teacher is one line.

Applied where the teacher's experts load (`teacher.model.load_expert`: every resident placement, eval, generate,
pipeline): W += strength * (alpha / rank) * B @ A, merged once in float32 and cast back to the teacher's dtype, which
is exact up to that one rounding because the teacher is frozen (and what diffusers' `fuse_lora(lora_scale=strength)`
computes). Nothing in a run needs the teacher without its LoRAs (targets, samples, the real and the fake score
(which starts from it) all distil the fine-tuned teacher), so nothing keeps them switchable. Where the weights are
read from the teacher's files as they are used -- the streamed blocks of offload and disk, an fp8 teacher quantized
as read (teacher.quantize=fp8), a student cut from the teacher's tensors -- an in-memory merge would be lost: there
the reader merges each tensor as it reads it (`patch_tensor`: placements/disk_source.py, student/prune.py), in
float32 before any cast or quantizing, so every placement distils the same fine-tuned teacher.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from safetensors import SafetensorError, safe_open
from torch import nn

from wandistiller.core.errors import UserError
from wandistiller.core.files import opened
from wandistiller.core.tensor_files import safetensors_problem
from wandistiller.teacher.spec import TeacherSpec

KEY = "teacher.lora"
PEFT_KEY = re.compile(r"(.+)\.lora_([AB])\.(weight|bias)")


@dataclass(frozen=True)
class TeacherLora:
    """One `teacher.lora` entry, checked: its file, strength, the experts it goes on and its content's sha256."""

    path: Path
    strength: float
    experts: tuple[str, ...]
    sha256: str

    def record(self) -> dict:
        """What run metadata (metrics.json, a checkpoint, adapters.json) says of it."""
        return {"path": str(self.path)} | self.public()

    def public(self) -> dict:
        """What a published file says of it (sampling.json, the model card): nothing of this machine."""
        return {"file": self.path.name, "strength": self.strength, "experts": list(self.experts), "sha256": self.sha256}


@dataclass(frozen=True)
class Layer:
    """One adapted Linear of a LoRA: down [rank, in], up [out, rank], an optional bias delta [out], and its scale
    (alpha / rank, 1 where a converter folded alpha into the tensors)."""

    down: torch.Tensor
    up: torch.Tensor
    bias: torch.Tensor | None
    scale: float


def entries(value: Any) -> list[tuple[str, Any, Any]]:
    """(path, strength, expert) per `teacher.lora` entry: null, one path, or a list of paths and
    {path, strength, expert} mappings. One line for anything else."""
    value = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    out = []
    for i, item in enumerate(items):
        where = f"{KEY}[{i}]" if isinstance(value, list) else KEY
        if isinstance(item, str):
            out.append((item, 1.0, None))
            continue
        if not isinstance(item, dict) or not isinstance(item.get("path"), str):
            raise UserError(
                f"{where}={item!r} is not a LoRA file; give a path or {{path: FILE, strength: 0.8}} "
                f"(e.g. {KEY}=[/loras/style.safetensors])"
            )
        unknown = sorted(set(item) - {"path", "strength", "expert"})
        if unknown:
            raise UserError(f"{where} has {unknown[0]!r}, which a LoRA entry does not take; use path, strength, expert")
        out.append((item["path"], item.get("strength", 1.0), item.get("expert")))
    return out


def relocated(value: Any, files: Sequence[str], where: str) -> list[dict]:
    """`teacher.lora` (`value`, as a run saved it in `where`) with its files where they lie now (`files`, one per
    entry in its order: `--teacher-lora`), strengths and experts kept. One line where the counts differ."""
    found = entries(value)
    if len(files) != len(found):
        named = ", ".join(Path(path).name for path, _, _ in found) or "none"
        raise UserError(
            f"--teacher-lora gives {len(files)} file(s), and {KEY} in {where} names {len(found)} ({named}); "
            "give one file per entry, in its order"
        )
    paths = [Path(file).expanduser() for file in files]
    missing = next((path for path in paths if not path.is_file()), None)
    if missing is not None:
        what = "is a folder" if missing.is_dir() else "no such file"
        raise UserError(f"--teacher-lora {missing}: {what}; give the run's LoRA files where they lie now")
    return [
        {"path": str(path.resolve()), "strength": strength, "expert": expert}
        for path, (_, strength, expert) in zip(paths, found)
    ]


def absolute(value: Any) -> Any:
    """`teacher.lora` as given, each path made absolute (from the directory the run was launched in): what the run's
    saved config keeps, so eval, generate and export launched elsewhere read the same files."""
    value = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value

    def one(item: Any) -> Any:
        if isinstance(item, str):
            return str(Path(item).expanduser().resolve())
        if isinstance(item, dict) and isinstance(item.get("path"), str):
            return item | {"path": str(Path(item["path"]).expanduser().resolve())}
        return item

    return [one(item) for item in value] if isinstance(value, list) else one(value)


def check_strength(where: str, strength: Any) -> float:
    """A finite number (bools and strings refused)."""
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength):
        raise UserError(f"{where}.strength={strength!r} is not a finite number; give e.g. strength: 0.8")
    return float(strength)


def teacher_loras(value: Any, experts: Sequence[str], config: dict) -> tuple[TeacherLora, ...]:
    """`teacher.lora` checked against the teacher (`experts`, its transformer `config`): each file read whole and
    checked (layout, keys, shapes), before anything is written. () for none."""
    given = entries(value)
    found = []
    for i, (path, strength, expert) in enumerate(given):
        where = f"{KEY}[{i}]" if len(given) > 1 or isinstance(value, (list, ListConfig)) else KEY
        strength = check_strength(where, strength)
        if expert is not None and expert not in experts:
            raise UserError(
                f"{where}.expert={expert!r} is not an expert of this teacher; use one of {', '.join(experts)}, "
                "or null (every expert)"
            )
        file = Path(path).expanduser().resolve()
        layers = read_lora(file, where)
        check_layers(layers, file, where, config)
        found.append(TeacherLora(file, strength, tuple(experts) if expert is None else (expert,), file_sha256(file)))
    return tuple(found)


def file_sha256(path: Path) -> str:
    """The file's content hash, read through the guard (the cache keys' and the card's stamp of it)."""
    h = hashlib.sha256()
    with opened(path.parent, path.name) as fd_path, open(fd_path, "rb") as f:
        for chunk in iter(lambda: f.read(2**24), b""):
            h.update(chunk)
    return h.hexdigest()


def read_lora(path: Path, where: str = KEY) -> dict[str, Layer]:
    """The LoRA file at `path` as its adapted layers by module name (`blocks.0.attn1.to_q`), whatever its layout;
    one line for a missing file, one that is not safetensors, or keys no converter knows."""
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "no such file"
        raise UserError(f"{where}={path}: {what}; give a LoRA .safetensors file of this teacher")
    problem = safetensors_problem(path)
    if problem is not None:
        raise UserError(f"{where}={path} is not a safetensors LoRA file ({problem[:200]})")
    try:
        with opened(path.parent, path.name) as fd_path, safe_open(fd_path, "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            raw = (f.metadata() or {}).get("lora_adapter_metadata")
    except (OSError, SafetensorError, ValueError) as e:
        raise UserError(f"{where}={path} cannot be read ({str(e)[:200]})") from None
    try:
        return _layers(tensors, raw)
    except (KeyError, ValueError, IndexError, RuntimeError, TypeError, AttributeError) as e:
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise UserError(
            f"{where}={path} is not a Wan LoRA in a layout this reads ({first}); give a LoRA in the Lightning/ComfyUI "
            "(diffusion_model.blocks.N...lora_down), diffusers/peft (blocks.N...lora_A) or kohya (lora_unet_...) layout"
        ) from None


def _layers(tensors: dict[str, torch.Tensor], raw_metadata: str | None) -> dict[str, Layer]:
    """diffusers' converters (Lightning, kohya) or peft's own keys; per module its halves and scale."""
    from diffusers import WanPipeline

    if not tensors:
        raise ValueError("it holds no tensors")
    converted = any(k.startswith(("diffusion_model.", "lora_unet_")) for k in tensors)
    state = WanPipeline.lora_state_dict(tensors) if converted else tensors
    if any(k.startswith("transformer.") for k in state):
        state = {k.removeprefix("transformer."): v for k, v in state.items()}
    config = {} if converted else _peft_config(raw_metadata)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        found = PEFT_KEY.fullmatch(key)
        if not found or (found[3] == "bias" and found[2] == "A"):
            raise ValueError(f"{key!r} is not a LoRA tensor of a transformer layer")
        halves.setdefault(found[1], {})[found[2] if found[3] == "weight" else "bias"] = tensor
    layers = {}
    for module, parts in halves.items():
        if "A" not in parts or "B" not in parts:
            raise ValueError(f"{module} has one half of an adapter (lora_A and lora_B go together)")
        rank = parts["A"].shape[0]
        r = config.get("rank_pattern", {}).get(module, config.get("r", rank))
        alpha = config.get("alpha_pattern", {}).get(module, config.get("lora_alpha", r))
        layers[module] = Layer(parts["A"], parts["B"], parts.get("bias"), float(alpha) / float(r))
    return layers


def _peft_config(raw: str | None) -> dict:
    """The LoraConfig diffusers writes beside its adapters (`lora_adapter_metadata`: r, lora_alpha, patterns, its
    keys maybe prefixed `transformer.`); {} without one (diffusers then takes alpha = rank)."""
    if not raw:
        return {}
    meta = json.loads(raw)
    if not isinstance(meta, dict):
        return {}
    return {k.removeprefix("transformer."): v for k, v in meta.items()}


@functools.lru_cache(maxsize=4)
def _linear_shapes(config_json: str) -> dict[str, tuple[int, int]]:
    """(out, in) features of every Linear of a WanTransformer3DModel of this config: a skeleton on the meta device."""
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(json.loads(config_json))
    return {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    return _linear_shapes(json.dumps({k: v for k, v in config.items() if not k.startswith("_")}, sort_keys=True))


def check_layers(layers: dict[str, Layer], path: Path, where: str, config: dict) -> None:
    """Every layer names a Linear of this teacher, with its widths and one rank for both halves: one line for
    another model's LoRA (a 1.3B one on a 14B: other widths; a 14B one on a 1.3B: blocks it lacks)."""
    shapes = linear_shapes(config)
    for module, layer in sorted(layers.items()):
        if module not in shapes:
            raise UserError(
                f"{where}={path} is not a LoRA of this teacher: it adapts {module}, which the teacher has no Linear "
                f"layer of (it has {config.get('num_layers')} blocks); give a LoRA trained on this teacher"
            )
        out, inp = shapes[module]
        down, up = tuple(layer.down.shape), tuple(layer.up.shape)
        bias = None if layer.bias is None else tuple(layer.bias.shape)
        fits = len(down) == 2 and len(up) == 2 and down[1] == inp and up[0] == out and up[1] == down[0]
        if not fits or bias not in (None, (out,)):
            raise UserError(
                f"{where}={path} is not a LoRA of this teacher: {module} is {out}x{inp} here, and its lora_A is "
                f"{list(down)}, lora_B {list(up)} (another model's LoRA, or a damaged one); give a LoRA trained on "
                "this teacher"
            )
        for tensor in (layer.down, layer.up) + (() if layer.bias is None else (layer.bias,)):
            if not torch.isfinite(tensor.float()).all():
                raise UserError(f"{where}={path} holds NaN or infinite values in {module}; give an intact LoRA file")


@torch.no_grad()
def merge(model: nn.Module, layers: dict[str, Layer], strength: float) -> None:
    """W += strength * scale * up @ down (and the bias += strength * scale * bias delta) in float32 on the weight's
    device, cast back once: exact up to that rounding, the teacher being frozen."""
    modules = dict(model.named_modules())
    for module, layer in layers.items():
        linear = modules[module]
        assert isinstance(linear, nn.Linear)
        weight = linear.weight
        factor = strength * layer.scale
        delta = layer.up.to(weight.device, torch.float32) @ layer.down.to(weight.device, torch.float32)
        weight.copy_((weight.float() + factor * delta).to(weight.dtype))
        if layer.bias is not None and linear.bias is not None:
            b = linear.bias
            b.copy_((b.float() + factor * layer.bias.to(b.device, torch.float32)).to(b.dtype))


def read_checked(lora: TeacherLora) -> dict[str, Layer]:
    """The layers of a checked `teacher.lora` entry, read again (the tensors are not kept between loads): one line
    where the file changed since it was checked, whose content the caches and checkpoints were keyed on."""
    if file_sha256(lora.path) != lora.sha256:
        raise UserError(
            f"{KEY}: {lora.path} changed since this run checked it (sha256 {lora.sha256[:12]} then); put that file "
            "back, or start again with the new one"
        )
    return read_lora(lora.path)


def apply(model: nn.Module, expert: str, loras: Sequence[TeacherLora]) -> None:
    """Every LoRA of `loras` that goes on `expert`, merged into `model` in order."""
    for lora in loras:
        if expert in lora.experts:
            merge(model, read_checked(lora), lora.strength)


# An expert's LoRAs read once, for a reader of its raw tensors (student/prune.py cuts a student from them).
Patch = Sequence[tuple[dict[str, Layer], float]]


def patch_of(loras: Sequence[TeacherLora], expert: str) -> Patch:
    """The layers and strength of every LoRA that goes on `expert`, read once."""
    return [(read_checked(lora), lora.strength) for lora in loras if expert in lora.experts]


@torch.no_grad()
def patch_tensor(key: str, tensor: torch.Tensor, patch: Patch, device: torch.device | None = None) -> torch.Tensor:
    """Tensor `key` of an expert (`blocks.0.attn1.to_q.weight`, as its files name it) with `patch` merged, in float32
    (computed on `device`, default the tensor's, and returned where the tensor was): what a streamed teacher reads
    in place of the stored tensor (placements/disk_source.py), so its blocks are the fine-tuned teacher's."""
    module, _, kind = key.rpartition(".")
    hits = [(layers[module], strength) for layers, strength in patch if module in layers]
    if kind not in ("weight", "bias") or not hits:
        return tensor
    out = tensor.to(device or tensor.device, torch.float32)
    for layer, strength in hits:
        factor = strength * layer.scale
        if kind == "weight":
            out = out + factor * (layer.up.to(out.device, torch.float32) @ layer.down.to(out.device, torch.float32))
        elif layer.bias is not None:
            out = out + factor * layer.bias.to(out.device, torch.float32)
    return out.to(tensor.device)


@torch.no_grad()
def patch_tensors(state: dict[str, torch.Tensor], patch: Patch) -> dict[str, torch.Tensor]:
    """`state` (an expert's float32 tensors by their names in it, any subset) with `patch` merged into the weights and
    biases it holds: the tensors a merged expert would hold, before any cast."""
    for layers, strength in patch:
        for module, layer in layers.items():
            factor = strength * layer.scale
            if f"{module}.weight" in state:
                state[f"{module}.weight"] = state[f"{module}.weight"] + factor * (layer.up.float() @ layer.down.float())
            if layer.bias is not None and f"{module}.bias" in state:
                state[f"{module}.bias"] = state[f"{module}.bias"] + factor * layer.bias.float()
    return state


def records(loras: Sequence[TeacherLora]) -> list[dict]:
    return [lora.record() for lora in loras]


def with_loras(spec: TeacherSpec, value: Any) -> TeacherSpec:
    """`spec` with `teacher.lora` (`value`) checked and attached: every loader and cache key then sees it."""
    loras = teacher_loras(value, spec.experts, spec.transformer_config)
    return dataclasses.replace(spec, loras=loras) if loras else spec


def stamp(loras: Sequence[TeacherLora]) -> list:
    """What a cache key or a digest holds of the LoRAs: content, strength and experts (not where the file lies)."""
    return [[lora.sha256, lora.strength, list(lora.experts)] for lora in loras]
