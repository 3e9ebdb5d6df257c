"""Schemas for the Hydra config tree.

One dataclass per config group, registered in Hydra's ConfigStore as `train_schema` and listed first in
`conf/train.yaml`'s defaults. Every YAML option then merges into a typed node, so a typo in a key or a
value of the wrong type fails at composition with Hydra's own message, before anything heavy loads.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

# The Hydra config tree ships inside the package, so a non-editable `pip install .` finds it too.
CONF_DIR = Path(__file__).resolve().parent / "conf"


class Choice(str, Enum):
    """A string option with a fixed set of values: a typo fails at composition, listing the valid ones."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Builtin(Choice):
    tiny = "tiny"
    tiny_moe = "tiny_moe"


class DType(Choice):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class StudentInit(Choice):
    random = "random"
    teacher = "teacher"
    auto = "auto"  # the teacher's blocks when the widths match, else random


class LoggerMode(Choice):
    offline = "offline"
    online = "online"
    disabled = "disabled"


# Every schedule diffusers.optimization.get_scheduler knows (its SchedulerType's values; tests/test_config.py checks
# they still agree). Written out: importing diffusers.optimization pulls in torch._dynamo, seconds in every process,
# including each one that only composes a config or refuses it.
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "piecewise_constant")  # fmt: skip
LrScheduler = Choice("LrScheduler", {name: name for name in SCHEDULERS})


@dataclass
class TeacherConfig:
    name: str = MISSING
    # A local diffusers-format Wan folder or a Hub id.
    path: str = MISSING
    # "tiny" / "tiny_moe": build this embedded teacher at `path` when it is not there yet.
    builtin: Builtin | None = None
    guidance_scale: float = 5.0
    # Two-expert teachers: CFG scale of the low-noise expert (`transformer_2`); None = guidance_scale.
    guidance_scale_2: float | None = None
    negative_prompt: str = ""
    max_sequence_length: int = 512
    # The prompts this teacher knows (the data options' default `data.prompts_path`); None = the shipped 70.
    prompts_path: str | None = None
    # Shift of the flow schedule training timesteps are drawn from; None = the teacher scheduler's.
    flow_shift: float | None = None
    # Regional torch.compile of the teacher's blocks (one graph reused by all); placements that run a
    # whole teacher in one process only (cpu, gpu, gpu0, offload, disk).
    compile: bool = False
    # "fp8": the blocks' Linear layers in fp8, quantized once at load (wandistiller.teacher.fp8; CPU, or Ada/Hopper+).
    quantize: str | None = None
    # diffusers attention backend for the teacher ("flash", "_native_cudnn", ...); None = diffusers' default.
    attention_backend: str | None = None


@dataclass
class PrecisionConfig:
    name: str = MISSING
    teacher_dtype: DType = MISSING
    student_dtype: DType = DType.fp32
    autocast_dtype: DType | None = None


def _data_sources():
    from wandistiller.data import sources

    return sources


# How clean latents x0 are made: one value per module of wandistiller/data/sources/ (gaussian, images, teacher).
Latents = Choice("Latents", {name: name for name in _data_sources().sources()})


@dataclass
class DataCommon:
    """The keys every data source has; defaults in conf/data/*.yaml."""

    # Prompts file, one per line; None = the prompts shipped with WanDistiller.
    prompts_path: str | None = MISSING
    # Student latents: 16 channels x frames x height x width (a 480x832 frame is 1 x 60 x 104).
    latent_frames: int = MISSING
    latent_height: int = MISSING
    latent_width: int = MISSING
    # The data source (wandistiller/data/sources/<name>.py).
    latents: Latents = MISSING
    # Held-out prompts for validation, one per line; None = the last `val_fraction` of the prompts.
    val_prompts_path: str | None = None
    val_fraction: float = 0.1


# The common keys plus each source's own (its `Keys`: latents_per_prompt, root, dataset, ...).
DataConfig = dataclasses.make_dataclass("DataConfig", _data_sources().schema_fields(), bases=(DataCommon,))
DataConfig.__module__ = __name__


@dataclass
class StudentConfig:
    # What builds the student: called with these keys plus the teacher's spec and a dtype (swap in your own).
    _target_: str = "wandistiller.student.model.build_student"
    # A named architecture from `wandistiller.student.model.STUDENT_BUILDERS`, or None with `config_path`.
    builder: str | None = None
    # A diffusers WanTransformer3DModel config.json (the old student_config.json).
    config_path: str | None = None
    # "teacher": copy embeddings and evenly spaced blocks (widths must match); "auto": that when the widths
    # match, else "random".
    init: StudentInit = StudentInit.auto
    # Weight of hidden-state distillation through a learned student->teacher width projection; 0 = off.
    hidden_kd_weight: float = 0.0


@dataclass
class TrainerConfig:
    """The loop's settings; their defaults live in conf/trainer/default.yaml alone."""

    batch_size: int = MISSING
    grad_accum_steps: int = MISSING
    # One teacher call for all of a step's micro-batches (a streamed teacher then moves its weights once
    # per step, not once per micro-batch); targets equal to rounding. Ranks that run their own teacher.
    teacher_whole_step: bool = MISSING
    max_steps: int = MISSING
    optimizer: Any = MISSING
    # (pred, target, student_hidden, teacher_hidden) -> (loss, velocity part, hidden part); swap with _target_.
    loss: Any = MISSING
    lr_scheduler: LrScheduler = MISSING
    warmup_steps: int = MISSING
    max_grad_norm: float | None = MISSING
    gradient_checkpointing: bool = MISSING
    # Regional torch.compile of the student's repeated blocks.
    compile_student: bool = MISSING
    # torch.compile mode for the student's blocks: None (default), "reduce-overhead" (CUDA graphs), "max-autotune".
    compile_mode: str | None = MISSING
    ema_decay: float | None = MISSING
    checkpoint_every: int = MISSING
    keep_checkpoints: int = MISSING
    # None: a new run; "auto": continue the latest checkpoint in the run folder; or a checkpoint folder.
    resume: str | None = MISSING
    # A resume refuses a teacher other than the one its checkpoint recorded, unless this is true.
    allow_other_teacher: bool = MISSING
    log_every: int = MISSING
    progress_bar: bool = MISSING
    # The teacher-vs-student PNG grid at the end: prompts shown and sampling steps; 0 prompts = skip.
    sample_prompts: int = MISSING
    sample_steps: int = MISSING
    # Held-out val/loss (and checkpoints/best/, loss.png) every N steps; 0 = never.
    val_every: int = MISSING
    # The grid every N steps, into samples/step_XXXXXXXX.png; 0 = only at the end.
    sample_every: int = MISSING
    # End with `python -m wandistiller.eval` (student vs teacher from the same noise) into metrics.json.
    eval_at_end: bool = MISSING


@dataclass
class DistributedConfig:
    # Workers per node, started from inside the Hydra job (or by torchrun, which then sets them).
    nproc_per_node: int = 1
    nnodes: int = 1
    # Multi-node rendezvous (c10d): host:port of the first node, and a job id shared by all nodes.
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    # Collective timeout: long enough for rank 0's one-off work (first load, checkpoint saves).
    timeout_min: float = 30.0


@dataclass
class HardwareConfig:
    """For the planner: null = detect this machine; set them to plan for other hardware on paper."""

    gpus: int | None = None
    gpu_memory_gib: float | None = None
    host_memory_gib: float | None = None
    # Left free on every device when planning: the larger of the two (GiB, and a fraction of the device).
    headroom_gib: float = 0.0
    headroom_fraction: float = 0.08
    # The placement table in full on the terminal (else one line; it always goes to train.log).
    show_plan: bool = False


@dataclass
class PathsConfig:
    cache_dir: str = MISSING
    output_dir: str = MISSING


@dataclass
class TrainConfig:
    teacher: TeacherConfig = MISSING
    # Each option has its own schema (wandistiller/placements/<option>.py), so this node is untyped here.
    teacher_placement: Any = MISSING
    precision: PrecisionConfig = MISSING
    data: DataConfig = MISSING
    student: StudentConfig = MISSING
    trainer: TrainerConfig = MISSING
    # The loggers by name (`logger=[wandb,tensorboard,csv]`), each with its own schema
    # (wandistiller/tracking/loggers/<name>.py); `logger=none`: none.
    logger: dict[str, Any] = field(default_factory=dict)
    # The loop's hooks by name (`hooks=[monitor,progress,samples,evaluate]`; evaluate runs
    # trainer.eval_at_end, so a list without it needs trainer.eval_at_end=false), each with its own schema
    # (wandistiller/recipe/hooks/<name>.py).
    hooks: dict[str, Any] = field(default_factory=dict)
    distributed: DistributedConfig = MISSING
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    paths: PathsConfig = MISSING
    # The recipe one process runs: setup() then train() (wandistiller.recipe.distillation.DistillationRecipe).
    recipe: Any = MISSING
    seed: int = 0


def shared_now(fmt: str) -> str:
    """`${now:}` that every local rank started by torchrun agrees on: the launching agent's start time.

    Lets `torchrun -m wandistiller.train` ranks compute one run folder without talking to each other.
    """
    started = time.time()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            ticks = int(Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
            boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
            started = boot + ticks / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError, StopIteration):
            pass
    return datetime.datetime.fromtimestamp(started).strftime(fmt)


def rank_suffix() -> str:
    rank = int(os.environ.get("RANK", 0))
    return f"_rank{rank}" if rank else ""


def register_configs() -> None:
    from wandistiller.placements import register_schemas
    from wandistiller.recipe import hooks
    from wandistiller.tracking import loggers

    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    register_schemas(store)
    loggers.register_schemas(store)
    hooks.register_schemas(store)
    OmegaConf.register_new_resolver("wd_now", shared_now, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("wd_rank_suffix", rank_suffix, replace=True)
    # A file shipped inside the package (the pocket teacher's folders): `${wd_assets:pocket/prompts.txt}`.
    OmegaConf.register_new_resolver("wd_assets", shipped_asset, replace=True)


def shipped_asset(rel: str = "") -> str:
    """`${wd_assets:REL}`: a path inside the package's assets, never outside it (received configs use it too)."""
    if ".." in Path(rel).parts or Path(rel).is_absolute():
        raise ValueError(f"wd_assets:{rel} leaves the package's assets; name a path inside them")
    return str(CONF_DIR.parent / "assets" / rel)


def compose_config(overrides: list[str]):
    """The tree `python -m wandistiller.train OVERRIDES` would run, composed outside a Hydra job (no run
    folder, no log file): for the planner's CLI and the tools. A bad override is one UserError."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from wandistiller.core.errors import UserError

    try:
        return _compose("train", overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise UserError(hydra_error_line(e)) from None


def compose_option(group: str, option: str):
    """One config group option, composed by Hydra with its schema and defaults, its interpolations left
    for the tree it is put into to resolve (e.g. `teacher_placement=auto` becoming the planner's choice)."""
    return _compose(None, [f"+{group}={option}"])[group]


def _compose(config_name: str | None, overrides: list[str]):
    """Hydra's compose, inside a Hydra job (which already set the search path) or outside one."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    if GlobalHydra.instance().is_initialized():
        return compose(config_name, overrides=overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name, overrides=overrides)


def hydra_error_line(error: Exception) -> str:
    """Hydra's own words (its list of valid options included) and their cause, on one line, ending in a fix
    that works: Hydra's "+key=value" hint is dropped, since an added key the schema lacks is refused too."""
    words = [str(error)] + ([str(error.__cause__)] if error.__cause__ else [])
    lines = [line.strip() for w in words for line in w.splitlines() if line.strip()]
    skip = ("Config search path", "provider=", "full_key", "reference_type", "object_type", "To append to your config")
    text = " ".join(line for line in lines if not line.startswith(skip))
    if "override 'logger." in text and "not in struct" in text:  # the flat keys of before the logger list
        return f"{text}; a logger's keys sit under its name: e.g. logger.wandb.mode=online"
    if "not in" in text and "Key '" in text:
        return f"{text}; check its spelling (python -m wandistiller.train --cfg job lists every key)"
    if "Could not find" in text:
        return f"{text}; pick one of those options"
    missing = re.search(r"Could not load '([\w/]+)/([^'/]+)'", text)  # an option in a list: Hydra names none
    if missing and (CONF_DIR / missing[1]).is_dir():
        options = sorted(p.stem for p in (CONF_DIR / missing[1]).glob("*.yaml"))
        return f"{text} Available options in '{missing[1]}': {' '.join(options)}; pick one of those options"
    return f"{text}; fix the value" if "could not be converted" in text or "Invalid value" in text else text


def check_overrides(argv: list[str]) -> None:
    """The command line's config overrides composed once before Hydra runs (each value of a sweep too), so
    a typo is one UserError line rather than Hydra's several lines and exit code 1. Flags and hydra.*
    overrides are Hydra's to check; nothing is loaded."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from wandistiller.core.errors import UserError

    other_config = ("-cn", "--config-name", "-cp", "--config-path", "-cd", "--config-dir")
    if any(a.split("=", 1)[0] in other_config for a in argv):  # another primary config: Hydra checks it
        return
    given = [a for a in argv if "=" in a and not a.startswith("-") and not a.lstrip("+~").startswith("hydra")]
    try:
        parsed = OverridesParser.create().parse_overrides(given)
        base = [o.input_line if not o.is_sweep_override() else _first(o) for o in parsed]
        variants = [base] + [
            base[:i] + [f"{o.get_key_element()}={v}"] + base[i + 1 :]
            for i, o in enumerate(parsed)
            if o.is_sweep_override() and o.is_choice_sweep()
            for v in list(o.sweep_string_iterator())[1:]
        ]
        for overrides in variants:
            _compose("train", [o for o in overrides if o is not None])
    except (HydraException, OmegaConfBaseException) as e:
        raise UserError(hydra_error_line(e)) from None


def _first(override) -> str | None:
    """A sweep override at its first value (None for range/interval sweeps: Hydra checks those)."""
    if not override.is_choice_sweep():
        return None
    return f"{override.get_key_element()}={next(iter(override.sweep_string_iterator()))}"
