"""The student: a WanTransformer3DModel built from a named architecture or a diffusers config.json.

Architecture constants live in wandistiller.core.arch.STUDENT_BUILDERS. What must agree with the teacher
(latent channels, patch size, text width) is inherited from the teacher unless a config file sets it,
and then checked before any weights load.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from wandistiller.core.arch import STUDENT_BUILDERS, TEACHER_SHAPED_STUDENTS, estimate_params, wan_config_problem
from wandistiller.core.errors import UserError
from wandistiller.core.precision import cast_keeping_fp32
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
)
# Keys that must equal the teacher's for the student to consume the same inputs and predict the same target.
MUST_MATCH = ("patch_size", "in_channels", "out_channels", "text_dim")
# Keys that must equal the teacher's to copy its blocks into the student (student.init=teacher).
WIDTHS = ("num_attention_heads", "attention_head_dim", "ffn_dim", "text_dim", "freq_dim", "qk_norm", "cross_attn_norm")


def student_config(student_cfg, teacher: dict) -> dict:
    """The student's WanTransformer3DModel config, checked against the teacher's transformer config.

    Reads JSON only, so the Hydra job and the planner can check a student without building it.
    """
    if student_cfg.init not in ("random", "teacher", "auto"):
        raise UserError(f"student.init={student_cfg.init!r} is unknown; use auto, random or teacher")
    if student_cfg.builder is not None:
        names = [*STUDENT_BUILDERS, *TEACHER_SHAPED_STUDENTS]
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
            "student: set student.builder (tiny, small, base, half) or use student=from_json student.config_path=…"
        )

    config = {k: teacher[k] for k in INHERITED if k in teacher} | own
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
        raise UserError(
            f"{source}: image_dim={config.get('image_dim')} but the teacher has image_dim={teacher.get('image_dim')} "
            "(a text-to-image student takes no image input); drop image_dim"
        )
    from diffusers import WanTransformer3DModel

    unknown = set(config) - set(WanTransformer3DModel.extract_init_dict(config)[0])
    if unknown:
        raise UserError(f"{source}: {sorted(unknown)} are not WanTransformer3DModel options; remove them")
    return config


def _builder_config(builder: str, teacher: dict) -> dict:
    """A named student's own options: fixed ones, or the teacher's widths at a share of its blocks."""
    if builder in STUDENT_BUILDERS:
        return dict(STUDENT_BUILDERS[builder])
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


def check_student(student_cfg, teacher: dict) -> dict:
    """student_config, plus what starting from the teacher's blocks needs (student.init=teacher)."""
    config = student_config(student_cfg, teacher)
    if student_cfg.init == "teacher":
        for key in WIDTHS:
            mine, theirs = config.get(key), teacher.get(key)
            if mine != theirs:
                raise UserError(
                    f"student.init=teacher copies the teacher's blocks, but the student's {key}={mine} and the "
                    f"teacher's is {theirs}; use student.init=auto (or random) or a student of the teacher's width"
                )
    return config


def starts_from_teacher(student_cfg, config: dict, teacher: dict) -> bool:
    """init=teacher, or init=auto with every width equal to the teacher's."""
    if student_cfg.init == "auto":
        return all(config.get(key) == teacher.get(key) for key in WIDTHS)
    return student_cfg.init == "teacher"


def _norm(v):
    return list(v) if isinstance(v, (list, tuple)) else v


class Student(nn.Module):
    """The student transformer plus, for hidden-state distillation, one learned projection to the teacher's width
    per student block the loss matches (`hidden_layers`, from the loss's `needs.student_hidden`).

    This wrapper is the one module the optimizer (and DDP) sees.
    """

    def __init__(self, transformer: nn.Module, teacher_width: int | None = None, hidden_layers: tuple[int, ...] = ()):
        super().__init__()
        self.transformer = transformer
        self.hidden_layers = tuple(hidden_layers)
        width = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        projections = [nn.Linear(width, teacher_width) for _ in self.hidden_layers] if teacher_width else []
        self.hidden_proj = nn.ModuleList(projections) if projections else None
        self._register_load_state_dict_pre_hook(_one_projection_of_before)

    def forward(
        self, x_t: torch.Tensor, t: torch.Tensor, cond: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        layers = self.hidden_layers if self.hidden_proj is not None else ()
        with capture_blocks(self.transformer, layers) as captured:
            pred = self.transformer(hidden_states=x_t, timestep=t, encoder_hidden_states=cond, return_dict=False)[0]
        if not layers:
            return pred, None
        return pred, tuple(proj(h) for proj, h in zip(self.hidden_proj, captured))


def _one_projection_of_before(state: dict, prefix: str, *args) -> None:
    """A checkpoint of before several-layer KD held one projection (`hidden_proj.weight`): it is the first one now."""
    for name in ("weight", "bias"):
        old = f"{prefix}hidden_proj.{name}"
        if old in state:
            state[f"{prefix}hidden_proj.0.{name}"] = state.pop(old)


def build_student(
    spec: TeacherSpec,
    dtype: torch.dtype = torch.float32,
    *,
    builder: str | None = None,
    config_path: str | None = None,
    init: str = "auto",
    hidden_layers: tuple[int, ...] = (),
) -> Student:
    """The student for this teacher (the default `student._target_`; the keys are the `student` config's, and
    `hidden_layers`, the student blocks the loss matches to the teacher's, comes from the loss)."""
    from diffusers import WanTransformer3DModel

    student_cfg = SimpleNamespace(builder=builder, config_path=config_path, init=init)
    config = check_student(student_cfg, spec.transformer_config)
    transformer = WanTransformer3DModel.from_config(config)
    teacher_width = spec.transformer_config["num_attention_heads"] * spec.transformer_config["attention_head_dim"]
    student = Student(transformer, teacher_width, hidden_layers)
    if starts_from_teacher(student_cfg, config, spec.transformer_config):
        init_from_teacher(student, spec)
        log.info("student: starts from the teacher's embeddings, head and evenly spaced blocks")
    else:
        log.info("student: random initialisation (student.init=%s)", init)
    return cast_keeping_fp32(student, dtype)  # Wan's norms stay fp32, as from_pretrained(torch_dtype=) keeps them


def teacher_weights(spec: TeacherSpec, rename, expert: str = "transformer") -> dict[str, torch.Tensor]:
    """Read the tensors of one expert that `rename(key) -> [new keys]` wants, from its safetensors
    files (sharded or not), without loading the rest."""
    from safetensors import safe_open

    state = {}
    for file in sorted((spec.path / expert).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                for new_key in rename(key):
                    state[new_key] = f.get_tensor(key)
    return state


def init_from_teacher(student: Student, spec: TeacherSpec) -> None:
    """Copy the teacher's embeddings, output head and evenly spaced blocks into the student.

    Reads the teacher's files directly (with two experts, `transformer`), so a rank that holds no
    teacher can start from it too. Widths were checked by build_student.
    """
    s = student.transformer
    n_s, n_t = len(s.blocks), spec.transformer_config["num_layers"]
    picks: dict[int, list[int]] = {}
    for i in range(n_s):
        picks.setdefault(round(i * (n_t - 1) / max(n_s - 1, 1)), []).append(i)

    def rename(key: str) -> list[str]:
        if not key.startswith("blocks."):
            return [key]
        _, j, rest = key.split(".", 2)
        return [f"blocks.{i}.{rest}" for i in picks.get(int(j), [])]

    state = teacher_weights(spec, rename)
    with torch.no_grad():
        for name, param in s.state_dict().items():
            param.copy_(state[name].to(param.dtype))
