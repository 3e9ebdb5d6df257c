"""`student=lora`: the student IS the placed teacher plus trainable low-rank adapters (teacher/lora.py), one set per
expert. No second copy of the base weights exists: the student's calls switch its adapters on around the teacher's
own frozen experts, the teacher's calls (targets, the real score) run the same modules with them off.

- Which placements: those whose `Placement.backprop` is True (the student's backward runs through the placed
  teacher in the training process, on every training rank); the others are refused, named from the registry.
- Only the adapters are trained, checkpointed, averaged over DDP ranks (the module DDP wraps holds them alone)
  and saved.
- A two-expert teacher (A14B, pocket_moe): each expert has its own adapter set, and each sample goes to the expert
  serving its t (`Teacher.expert_index`): each set trains on the timesteps its expert serves, as WanPipeline
  switches at sampling.
- What a user loads: `<run>/student/` holds the adapters in the format diffusers writes (`WanPipeline.
  save_lora_weights`, peft's key names): `pytorch_lora_weights.safetensors` for `transformer` (the high-noise expert
  of a pair), `pytorch_lora_weights_transformer_2.safetensors` for `transformer_2` (`load_lora_weights(...,
  load_into_transformer_2=True)`), and `adapters.json` (rank, alpha, layers, the teacher they belong to). A few-step
  student's `sampling.json` is written beside them (state/export.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import ListConfig, OmegaConf
from safetensors import SafetensorError, safe_open
from torch import nn

from wandistiller.core.errors import UserError
from wandistiller.core.files import in_run, opened, write_in_run
from wandistiller.teacher.lora import AdaptedTeacher, Adapters, layer_names, narrowest
from wandistiller.teacher.model import Teacher, load_expert
from wandistiller.teacher.spec import TeacherSpec

BUILDER = "lora"
WEIGHTS = ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_transformer_2.safetensors")  # per expert
ADAPTERS_JSON = "adapters.json"


def is_lora(student_cfg) -> bool:
    """Whether a `student` node (or a run's saved one) is a LoRA student."""
    return student_cfg is not None and _get(student_cfg, "builder") == BUILDER


def is_lora_folder(folder: Path) -> bool:
    """Whether a saved student folder holds adapters (else a WanTransformer3DModel)."""
    return (folder / WEIGHTS[0]).is_file()


def lora_settings(student_cfg) -> tuple[int, float | None, tuple[str, ...]]:
    """(rank, alpha, adapted layer names) of a `student=lora` node, each refused in one line where it is wrong."""
    rank, alpha, layers = _get(student_cfg, "rank"), _get(student_cfg, "alpha"), _get(student_cfg, "layers")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise UserError(f"student.rank={rank} must be a positive integer (the adapters' rank); e.g. student.rank=16")
    # inf passed (nan did not), and the run went non-finite at its first step, blamed on the LR
    if alpha is not None and not (isinstance(alpha, (int, float)) and 0 < alpha < math.inf):
        raise UserError(f"student.alpha={alpha} must be a positive finite number, or null (alpha = rank: a scale of 1)")
    try:
        names = layer_names(_plain(layers))
    except ValueError as e:
        raise UserError(f"student.layers={_plain(layers)}: {e}") from None
    return rank, (float(alpha) if alpha is not None else None), names


def check_rank(key: str, rank: int, teacher: dict, names=None) -> None:
    """A rank no wider than the narrowest adapted layer of the teacher (its config.json): wider adds parameters and
    no capacity (a rank-r product of an n-wide layer has rank at most n)."""
    widest = narrowest(teacher, layer_names(names))
    if rank > widest:
        raise UserError(
            f"{key}={rank} is wider than the narrowest adapted layer of the teacher ({widest} features); "
            f"use {key}<={widest} (a rank above it adds parameters and nothing else)"
        )


def check_lora_student(student_cfg, teacher: dict) -> tuple[int, float | None, tuple[str, ...]]:
    """`student=lora` against its keys and the teacher, from JSON alone: no student.init, no shape keys, a rank
    that fits."""
    init = str(_get(student_cfg, "init"))
    if init != "auto":
        raise UserError(
            f"student.init={init} with student=lora: a LoRA student is the teacher itself plus adapters "
            "that start at zero, it starts from nothing else; drop student.init"
        )
    for key, default in (("config_path", None), ("keep_blocks", "auto")):
        if _plain(_get(student_cfg, key, default)) != default:
            raise UserError(
                f"student.{key}={_plain(_get(student_cfg, key))} with student=lora: a LoRA student has the "
                f"teacher's shape; drop student.{key} (or pick another student)"
            )
    rank, alpha, names = lora_settings(student_cfg)
    check_rank("student.rank", rank, teacher, names)
    return rank, alpha, names


def check_not_lora_keys(student_cfg) -> None:
    """rank, alpha and layers belong to student=lora: set on another student they would be ignored."""
    for key in ("rank", "alpha", "layers"):
        if _get(student_cfg, key) is not None:
            raise UserError(
                f"student.{key}={_plain(_get(student_cfg, key))} is a LoRA student's setting, and "
                f"student.builder={_get(student_cfg, 'builder')}; use student=lora, or drop "
                f"student.{key}"
            )


class LoraStudent(AdaptedTeacher):
    """The placed teacher with the student's adapters: called as a Student is, (x_t, t, cond) -> (velocity, None)."""

    def __init__(
        self,
        teacher: Teacher,
        rank: int,
        dtype: torch.dtype,
        seed: int,
        alpha: float | None = None,
        layers: tuple[str, ...] = (),
    ):
        names = layers or layer_names(None)
        super().__init__(teacher, rank, dtype, seed, alpha, names)
        self.rank, self.alpha, self.layers = rank, alpha, tuple(names)

    @property
    def experts(self) -> list[nn.Module]:
        return self.teacher[0].experts

    def identity(self) -> dict:
        """What a checkpoint records of it: a resume under another rank, alpha or set of layers is refused."""
        return {"builder": BUILDER, "rank": self.rank, "alpha": self.alpha, "layers": list(self.layers)}

    def save(self, folder: Path, teacher_record: dict | None = None) -> None:
        save_adapters(folder, [cast(Adapters, a) for a in self.adapters], teacher_record)


def build_lora_student(
    spec: TeacherSpec,
    dtype: torch.dtype = torch.float32,
    *,
    teacher: Teacher | None = None,
    rank: int = 16,
    alpha: float | None = None,
    layers: Any = "all",
    **unused,
) -> LoraStudent:
    """`student=lora`'s `_target_`: adapters on the run's placed `teacher` (the recipe passes it; builder, init
    and the other keys of the `student` node are checked by preflight and take no part here). A's draw comes from
    the global generator the recipe seeds (trainer seed): the same on every rank."""
    if teacher is None:
        raise UserError(
            "student=lora needs the placed teacher (it is the teacher plus adapters); train it with "
            "python -m wandistiller.train"
        )
    seed = int(torch.randint(2**31 - 1, (1,)))
    return LoraStudent(teacher, rank, dtype, seed, alpha, layer_names(_plain(layers)))


# -- saved adapters ---------------------------------------------------------------------------------------------
def save_adapters(folder: Path, adapters: list[Adapters], teacher_record: dict | None = None) -> None:
    """The adapters as diffusers writes them (one file per expert) and adapters.json."""
    from diffusers import WanPipeline

    folder.mkdir(parents=True, exist_ok=True)
    for adapter, name in zip(adapters, WEIGHTS):
        state = {k: v.detach().cpu().contiguous() for k, v in adapter.peft_state_dict().items()}
        WanPipeline.save_lora_weights(
            folder,
            transformer_lora_layers=state,
            weight_name=name,
            transformer_lora_adapter_metadata=adapter.peft_metadata(),
        )
    first = adapters[0]
    about = {
        "rank": first.rank,
        "alpha": first.alpha,
        "experts": len(adapters),
        "files": list(WEIGHTS[: len(adapters)]),
        "layers": sorted({n.split(".", 2)[2] for n in first.layers.values()}),
        "params": sum(p.numel() for a in adapters for p in a.parameters()),
    }
    if teacher_record:
        about["teacher"] = teacher_record
    write_in_run(folder, ADAPTERS_JSON, json.dumps(about, indent=2))


def read_adapters(folder: Path, experts: int, root: Path | None = None) -> list[tuple[dict, dict]]:
    """(peft state dict without its `transformer.` prefix, LoraConfig metadata) per expert, as diffusers reads
    them (`WanPipeline.lora_state_dict`); one line where a file is missing or is not adapters. `root`: the folder
    the files may not lead out of (a run's, whose own links inside it are followed); None: `folder`."""
    out = []
    for name in WEIGHTS[:experts]:
        in_run(root or folder, folder / name)  # a link out (a dangling one too) is named as such, not as missing
        if not (folder / name).is_file():
            raise UserError(
                f"the LoRA student in {folder} has no {name} (one file per expert of the teacher); "
                "use --checkpoint latest (or another)"
            )
        # Through the guard (never a link out of the folder, nor a file swapped in meanwhile): diffusers gets a dict.
        try:
            state, meta = _read_adapter_file(root or folder, folder / name)
        except (OSError, ValueError, RuntimeError, UserError, SafetensorError) as e:
            raise UserError(
                f"the LoRA student in {folder}: {name} cannot be read ({str(e)[:200]}); use "
                "--checkpoint latest (or another)"
            ) from None
        meta = {k.removeprefix("transformer."): v for k, v in (meta or {}).items()}
        out.append(({k.removeprefix("transformer."): v for k, v in state.items()}, meta))
    return out


def _read_adapter_file(root: Path, name: str | Path) -> tuple[dict, dict | None]:
    """(state dict, diffusers' LoRA metadata) of one adapters file, read from the descriptor the guard opened, as
    diffusers' own path loader reads it (`lora_adapter_metadata` in its header, JSON); diffusers converts the dict."""
    from diffusers import WanPipeline

    with opened(root, name) as path, safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        raw = (f.metadata() or {}).get("lora_adapter_metadata")
    meta = json.loads(raw) if raw else None
    return WanPipeline.lora_state_dict(tensors), meta if isinstance(meta, dict) else None


def adapters_from(
    source: Path, student_cfg, experts: list[nn.Module], checkpoint: dict | None = None, root: Path | None = None
) -> list[Adapters]:
    """Adapters hooked onto `experts` (off) holding a run's student: a saved `student/` folder (diffusers' files)
    at `source` (read inside `root`, see `read_adapters`), or a checkpoint's training state's `student`
    (LoraStudent.state_dict: `checkpoint`, read by the caller: state/ sits above this layer)."""
    rank, alpha, names = lora_settings(student_cfg)
    made = [Adapters(e, rank, torch.float32, 0, alpha, names) for e in experts]
    try:
        if checkpoint is None:
            for adapter, (state, _) in zip(made, read_adapters(source, len(experts), root)):
                adapter.load_peft_state_dict(state)
        else:
            nn.ModuleDict({"adapters": nn.ModuleList(made)}).load_state_dict(checkpoint)
    except (KeyError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(
            f"the LoRA student in {source} does not fit this run's student.rank/alpha/layers "
            f"({first}); give the run folder it was trained in"
        ) from None
    return made


def merged_experts(
    spec: TeacherSpec,
    source: Path,
    student_cfg,
    dtype: torch.dtype,
    device: torch.device,
    checkpoint: dict | None = None,
    root: Path | None = None,
) -> list[nn.Module]:
    """The teacher's experts (loaded afresh) with a run's adapters (`adapters_from`) merged into their weights
    (W + alpha/rank B A): the LoRA student as plain WanTransformer3DModels, for eval and generate."""

    # Loaded in `dtype` (an A14B teacher in fp32 would take twice its RAM): merge_into adds in float64, casts once.
    experts = [load_expert(spec, name, dtype) for name in spec.experts]
    for expert, adapter in zip(experts, adapters_from(source, student_cfg, experts, checkpoint, root)):
        adapter.merge_into(expert)
    return [e.to(device) for e in experts]


def _get(node, key: str, default=None):
    """`node.key`: a config node's (DictConfig, dict) or another object's attribute (a caller's namespace)."""
    return node.get(key, default) if hasattr(node, "get") else getattr(node, key, default)


def _plain(value):

    return OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
