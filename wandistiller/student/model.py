"""The student: a WanTransformer3DModel built from a named architecture or a diffusers config.json.

Architecture constants live in wandistiller.core.arch.STUDENT_BUILDERS. What must agree with the teacher
(latent channels, patch size, text width) is inherited from the teacher unless a config file sets it,
and then checked before any weights load.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import ListConfig, OmegaConf
from torch import nn

from wandistiller.core.arch import (
    PRUNED_STUDENTS,
    STUDENT_BUILDERS,
    TEACHER_SHAPED_STUDENTS,
    Layout,
    estimate_params,
    wan_config_problem,
)
from wandistiller.core.errors import UserError
from wandistiller.core.precision import cast_keeping_fp32
from wandistiller.student import lora, prune
from wandistiller.teacher.finetune import patch_of
from wandistiller.teacher.image import ImageCondition, expert_inputs
from wandistiller.teacher.model import capture_blocks
from wandistiller.teacher.spec import TeacherSpec

log = logging.getLogger(__name__)

# Keys the student takes from the teacher unless its config sets them.
INHERITED = (
    "patch_size",
    "in_channels",
    "out_channels",
    "text_dim",
    "freq_dim",
    "qk_norm",
    "cross_attn_norm",
    "eps",
    "rope_max_seq_len",
    # Wan 2.1 I2V: the width of the CLIP image tokens every block attends to (the teacher's image encoder's).
    "image_dim",
    "pos_embed_seq_len",
)
# Keys that must equal the teacher's for the student to consume the same inputs and predict the same target.
MUST_MATCH = ("patch_size", "in_channels", "out_channels", "text_dim")
# Keys that must equal the teacher's to copy its blocks into the student (student.init=teacher).
WIDTHS = ("num_attention_heads", "attention_head_dim", "ffn_dim", "text_dim", "freq_dim", "qk_norm", "cross_attn_norm")


def student_config(student_cfg, teacher: dict) -> dict:
    """The student's WanTransformer3DModel config, checked against the teacher's transformer config.

    Reads JSON only, so the Hydra job and the planner can check a student without building it. A LoRA student
    (`student=lora`) is the teacher itself plus adapters: its config is the teacher's.
    """
    if lora.is_lora(student_cfg):
        lora.check_lora_student(student_cfg, teacher)
        return teacher_shape(teacher)
    lora.check_not_lora_keys(student_cfg)
    names = [*STUDENT_BUILDERS, *TEACHER_SHAPED_STUDENTS, *PRUNED_STUDENTS, lora.BUILDER]
    if student_cfg.builder is not None:
        if student_cfg.builder not in names:
            raise UserError(
                f"student.builder={student_cfg.builder!r} is unknown; use one of {', '.join(names)} "
                "or student=from_json student.config_path=…"
            )
        own, source = _builder_config(student_cfg.builder, teacher), f"student={student_cfg.builder}"
    elif student_cfg.config_path is not None:
        path = Path(student_cfg.config_path).expanduser()
        source = f"student.config_path={str(path)!r}"
        own = _read_student_json(path, source)
    else:
        raise UserError(
            f"student: set student.builder ({', '.join(names)}) or use student=from_json student.config_path=…"
        )

    config = {k: teacher[k] for k in INHERITED if k in teacher} | own
    heads, head_dim = config.get("num_attention_heads"), config.get("attention_head_dim")
    width = heads * head_dim if isinstance(heads, int) and isinstance(head_dim, int) else None
    if config.get("image_dim") is not None and "added_kv_proj_dim" not in own and width is not None:
        # The image tokens are embedded to the blocks' width, then projected to keys and values of that width.
        config["added_kv_proj_dim"] = width
    problem = wan_config_problem(config)
    if problem:
        raise UserError(f"{source}: {problem}")
    for key in MUST_MATCH:
        mine, theirs = _norm(config.get(key)), _norm(teacher.get(key))
        if mine != theirs:
            raise UserError(
                f"{source}: {key}={mine} but the teacher has {key}={theirs}; "
                f"set it to {theirs} (or drop it to inherit the teacher's)"
            )
    if config.get("image_dim") != teacher.get("image_dim"):
        why = "(a text-to-video teacher gives no image tokens)" if teacher.get("image_dim") is None else "(its CLIP's)"
        raise UserError(
            f"{source}: image_dim={config.get('image_dim')} but the teacher has image_dim={teacher.get('image_dim')} "
            f"{why}; drop image_dim to inherit the teacher's"
        )
    if config.get("image_dim") is not None and width is not None and config.get("added_kv_proj_dim") != width:
        raise UserError(
            f"{source}: added_kv_proj_dim={config.get('added_kv_proj_dim')} but the student's blocks are {width} "
            "wide, the width its image tokens are embedded to; drop added_kv_proj_dim (it follows the width)"
        )
    from diffusers import WanTransformer3DModel

    unknown = set(config) - set(WanTransformer3DModel.extract_init_dict(config)[0])
    if unknown:
        raise UserError(f"{source}: {sorted(unknown)} are not WanTransformer3DModel options; remove them")
    return config


def teacher_shape(teacher: dict) -> dict:
    """The teacher's transformer config as WanTransformer3DModel takes it (diffusers' `_class_name`-style keys
    dropped): a LoRA student's shape."""
    return {k: v for k, v in teacher.items() if not k.startswith("_")}


def _builder_config(builder: str, teacher: dict) -> dict:
    """A named student's own options: fixed ones, the teacher's widths at a share of its blocks, or the teacher's
    shape at a share of its parameters (cut from it)."""
    if builder in STUDENT_BUILDERS:
        return dict(STUDENT_BUILDERS[builder])
    if builder in PRUNED_STUDENTS:
        try:
            shape = prune.pruned_shape(teacher, PRUNED_STUDENTS[builder], estimate_params)
        except ValueError as e:
            raise UserError(f"student={builder}: {e}; use a larger student (student=half)") from None
        return {k: teacher[k] for k in WIDTHS if k in teacher} | shape
    blocks = max(1, int(teacher["num_layers"] * TEACHER_SHAPED_STUDENTS[builder]))
    return {k: teacher[k] for k in WIDTHS if k in teacher} | {"num_layers": blocks}


def _read_student_json(path: Path, source: str) -> dict:
    """The options a student config.json sets (diffusers' own `_class_name`-style keys dropped)."""
    if path.is_dir():
        raise UserError(f"{source} is a folder; give the WanTransformer3DModel config.json inside it")
    if not path.is_file():
        raise UserError(f"{source} does not exist; give a WanTransformer3DModel config.json")
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise UserError(f"{source} is {path.stat().st_size} bytes; a WanTransformer3DModel config.json is ~1 KB")
        body = json.loads(path.read_text(encoding="utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{source} is not valid JSON ({e}); give a WanTransformer3DModel config.json") from None
    except RecursionError:
        raise UserError(
            f"{source} is nested too deeply to read; use a flat WanTransformer3DModel config.json"
        ) from None
    except OSError as e:
        raise UserError(f"{source} cannot be read ({e.strerror})") from None
    if not isinstance(body, dict):
        raise UserError(f"{source}: {wan_config_problem(body)}")
    return {k: v for k, v in body.items() if not k.startswith("_")}


MAX_CONFIG_BYTES = 1 << 20
# The keys that set a student's size, in the order a refusal names the largest (relative to the teacher's).
SIZE_KEYS = ("num_layers", "ffn_dim", "num_attention_heads", "attention_head_dim", "text_dim", "freq_dim")


def check_student_fits(config: dict, teacher: dict, host_bytes: int, gpu_bytes: tuple[int, ...]) -> None:
    """Refuse a student whose float32 weights alone exceed host memory (it is built there) or the largest GPU:
    estimated by arithmetic, so a typo (num_layers=3000000) fails now, not in an allocation minutes later."""
    need = estimate_params(config) * 4
    for where, capacity in (("host memory", host_bytes), ("GPU memory", max(gpu_bytes, default=None))):
        if capacity is not None and need > capacity:
            key = max(SIZE_KEYS, key=lambda k: config[k] / max(teacher.get(k) or 1, 1))
            raise UserError(
                f"student {key}={config[key]}: ~{need / 2**30:.1f} GiB of float32 weights, more than the "
                f"{capacity / 2**30:.1f} GiB of {where} here; use a smaller {key} (or a smaller student)"
            )


INITS = ("auto", "random", "teacher")


def check_student(student_cfg, teacher: dict) -> dict:
    """student_config, plus what its start needs: init=teacher or a folder it can be cut from, and a keep-list
    that names that source's blocks. JSON only: refused before anything heavy loads."""
    config = student_config(student_cfg, teacher)
    if lora.is_lora(student_cfg):  # the teacher itself: nothing is cut or copied (student/lora.py)
        return config
    init, keep = str(student_cfg.init), getattr(student_cfg, "keep_blocks", "auto")
    source = init_source(student_cfg, teacher)
    if init == "teacher":
        problem = prune.pruning_problem(config, teacher)
        if problem:
            raise UserError(
                f"student.init=teacher cuts the student from the teacher, but {problem}; use student.init=auto "
                f"(or random), or a student of the teacher's head size ({teacher['attention_head_dim']}) no larger "
                "than it (student=half, quarter or tenth)"
            )
    elif init not in INITS:
        assert source is not None  # a folder: init_source read its config
        problem = prune.pruning_problem(config, source[1])
        if problem:
            raise UserError(
                f"student.init={init} cannot start this student: {problem}; give a folder of a model at least "
                "as large with the same head size and channels, or pick a student that fits in it"
            )
    keep = _plain(keep)
    n_source = (source[1] if source else teacher)["num_layers"]
    problem = prune.keep_blocks_problem(keep, config["num_layers"], n_source)
    if problem:
        raise UserError(
            f"student.keep_blocks={keep} {problem}; give {config['num_layers']} distinct block indices from 0 to "
            f"{n_source - 1}, or auto (scored on calibration inputs) or even"
        )
    if not isinstance(keep, str) and not starts_from_teacher(student_cfg, config, teacher) and init in INITS:
        raise UserError(
            f"student.keep_blocks={keep} picks blocks to copy, but student.init={init} starts from random weights; "
            "use student.init=teacher (or a folder), or drop student.keep_blocks"
        )
    return config


def init_source(student_cfg, teacher: dict) -> tuple[Path, dict] | None:
    """The folder a student.init=<folder> names and its config; None for auto, random and teacher."""
    init = str(student_cfg.init)
    if init in INITS:
        return None
    folder = Path(init).expanduser()
    if not folder.exists() and "/" not in init:
        raise UserError(f"student.init={init} is not auto, random or teacher, nor a folder; use one of those")
    try:
        return folder, prune.read_folder_config(folder, received=True)  # someone's folder: the teacher's checks
    except ValueError as e:
        raise UserError(
            f"student.init={init} {e}; give a WanTransformer3DModel folder (a model's transformer/ or a run's "
            "student/), or auto, random or teacher"
        ) from None


def starts_from_teacher(student_cfg, config: dict, teacher: dict) -> bool:
    """init=teacher, or init=auto with a student that can be cut from the teacher (its head size, no larger)."""
    if student_cfg.init == "auto":
        return prune.pruning_problem(config, teacher) is None
    return student_cfg.init == "teacher"


def _plain(value):
    """A keep-list from OmegaConf (a ListConfig) as a list; anything else as it is."""

    return OmegaConf.to_container(value) if isinstance(value, ListConfig) else value


def _norm(v):
    return list(v) if isinstance(v, (list, tuple)) else v


class Student(nn.Module):
    """The student transformer plus, for hidden-state distillation, one learned projection to the teacher's width
    per student block the loss matches (`hidden_layers`, from the loss's `needs.student_hidden`).

    This wrapper is the one module the optimizer (and DDP) sees.
    """

    pruning: dict  # set when cut from the teacher or a folder (prune.prune_into): what was kept and why
    # What it takes besides noise and text: its teacher's (build_student), text alone where none was said.
    layout: Layout = Layout.t2v

    def __init__(self, transformer: nn.Module, teacher_width: int | None = None, hidden_layers: tuple[int, ...] = ()):
        super().__init__()
        self.transformer = transformer
        self.hidden_layers = tuple(hidden_layers)
        config: Any = transformer.config  # a diffusers model's (nn.Module's attributes are typed Tensor | Module)
        width = config.num_attention_heads * config.attention_head_dim
        self.teacher_width = teacher_width
        projections = [nn.Linear(width, teacher_width) for _ in self.hidden_layers] if teacher_width else []
        self.hidden_proj = nn.ModuleList(projections) if projections else None

    def match(self, hidden_layers: tuple[int, ...], dtype: torch.dtype) -> None:
        """Project these student blocks to the teacher's width: for a loss that settles its blocks once the student
        is built (its depth and keep-map known). At the teacher's own width a projection starts as the identity
        (still learned): a block cut from the teacher then starts matched to the block it came from."""
        assert self.teacher_width and self.hidden_proj is None, "match once, on a student built without hidden_layers"
        config: Any = self.transformer.config
        width = config.num_attention_heads * config.attention_head_dim
        self.hidden_layers = tuple(hidden_layers)
        projections = [nn.Linear(width, self.teacher_width, dtype=dtype) for _ in hidden_layers]
        if width == self.teacher_width:
            with torch.no_grad():
                for proj in projections:
                    proj.weight.copy_(torch.eye(width, dtype=dtype))
                    proj.bias.zero_()
        self.hidden_proj = nn.ModuleList(projections)

    def forward(
        self, x_t: torch.Tensor, t: torch.Tensor, cond: torch.Tensor, image: ImageCondition | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Velocity (and matched blocks' hidden states); the student of an image-to-video teacher takes `image` as
        the teacher does (teacher/image.py: the same layout, its inputs built the same way)."""
        layers = self.hidden_layers if self.hidden_proj is not None else ()
        config: Any = self.transformer.config
        inputs = expert_inputs(self.layout, config.patch_size, x_t, t, image, x_t.dtype)
        with capture_blocks(self.transformer, layers) as captured:
            pred = self.transformer(**inputs, encoder_hidden_states=cond, return_dict=False)[0]
        if not layers:
            return pred, None
        assert self.hidden_proj is not None  # layers are matched only with projections
        return pred, tuple(proj(h) for proj, h in zip(self.hidden_proj, captured))


def current_state(state: dict) -> dict:
    """A saved student state as Student names it: a checkpoint from before several-layer KD held one
    projection (`hidden_proj.weight`), the first of the current list (`hidden_proj.0.weight`). Compatibility with this
    project's pre-release checkpoints: removed in 0.2 (docs/ARCHITECTURE.md)."""
    renamed = {f"hidden_proj.{name}": f"hidden_proj.0.{name}" for name in ("weight", "bias")}
    return {renamed.get(key, key): value for key, value in state.items()}


def build_student(
    spec: TeacherSpec,
    dtype: torch.dtype = torch.float32,
    *,
    builder: str | None = None,
    config_path: str | None = None,
    init: str = "auto",
    keep_blocks="auto",
    hidden_layers: tuple[int, ...] = (),
    rank: int | None = None,
    alpha: float | None = None,
    layers=None,
    checked: dict | None = None,
) -> Student:
    """The student for this teacher (the default `student._target_`; the keys are the `student` config's, and
    `hidden_layers`, the student blocks the loss matches to the teacher's, comes from the loss). `checked`: its
    config as the run's preflight checked it against this teacher (check_student), not checked again; None: here.

    Started from the teacher (or a student.init folder), it carries `pruning`: what was kept and why."""
    from diffusers import WanTransformer3DModel

    student_cfg = OmegaConf.create(
        {
            "builder": builder,
            "config_path": config_path,
            "init": str(init),
            "keep_blocks": _plain(keep_blocks),
            "rank": rank,
            "alpha": alpha,
            "layers": _plain(layers),
        }  # (student=lora's keys: refused here)
    )
    config = checked if checked is not None else check_student(student_cfg, spec.transformer_config)
    transformer = WanTransformer3DModel.from_config(config)
    teacher_width = spec.transformer_config["num_attention_heads"] * spec.transformer_config["attention_head_dim"]
    student = Student(transformer, teacher_width, hidden_layers)
    student.layout = spec.layout
    source = init_source(student_cfg, spec.transformer_config)
    patch: prune.Patch = ()
    if source is None and starts_from_teacher(student_cfg, config, spec.transformer_config):
        source = (spec.path / "transformer", spec.transformer_config)
        patch = patch_of(spec.loras, "transformer")  # a fine-tuned teacher's LoRAs: cut from the teacher it is
    if source is not None:
        student.pruning = prune.prune_into(transformer, *source, keep=student_cfg.keep_blocks, patch=patch)
    else:
        log.info("student: random initialisation (student.init=%s)", init)
    return cast_keeping_fp32(student, dtype)  # Wan's norms stay fp32, as from_pretrained(torch_dtype=) keeps them
