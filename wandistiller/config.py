"""Schemas for the Hydra config tree.

One dataclass per config group, registered in Hydra's ConfigStore as `train_schema` and listed first in
`conf/train.yaml`'s defaults. Every YAML option then merges into a typed node, so a typo in a key or a
value of the wrong type fails at composition with Hydra's own message, before anything heavy loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING

# The Hydra config tree ships inside the package, so a non-editable `pip install .` finds it too.
CONF_DIR = Path(__file__).resolve().parent / "conf"


class Choice(str, Enum):
    """A string option with a fixed set of values: a typo fails at composition, listing the valid ones."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Builtin(Choice):  # teacher/tiny.py's BUILTINS
    tiny = "tiny"
    tiny_moe = "tiny_moe"
    tiny_i2v = "tiny_i2v"
    tiny_i2v_moe = "tiny_i2v_moe"
    tiny_ti2v = "tiny_ti2v"


class DType(Choice):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


# Every schedule diffusers.optimization.get_scheduler knows (its SchedulerType's values; tests/test_config.py checks
# they still agree). Written out: importing diffusers.optimization pulls in torch._dynamo, seconds in every process,
# including each one that only composes a config or refuses it.
SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "piecewise_constant",
)
if TYPE_CHECKING:  # an Enum made from a tuple: to mypy, one of the Choice strings
    LrScheduler = Choice
else:
    LrScheduler = Choice("LrScheduler", {name: name for name in SCHEDULERS})


@dataclass
class TeacherConfig:
    name: str = MISSING
    # A local diffusers-format Wan folder or a Hub id.
    path: str = MISSING
    # "tiny", "tiny_moe", "tiny_i2v", ...: build this embedded teacher at `path` when it is not there yet.
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
    # LoRA files applied to the teacher before distillation (a fine-tuned teacher: wandistiller/teacher/finetune.py):
    # a list of paths and/or {path: FILE, strength: 0.8, expert: null|transformer|transformer_2}; strength 1 and every
    # expert by default. Lightning/ComfyUI, diffusers/peft and kohya layouts; merged once into the teacher's weights.
    #   teacher.lora=[/loras/style.safetensors]   teacher.lora=[{path:/loras/style.safetensors,strength:0.8}]
    lora: Any = None


@dataclass
class PrecisionConfig:
    name: str = MISSING
    teacher_dtype: DType = MISSING
    student_dtype: DType = DType.fp32
    autocast_dtype: DType | None = None


@dataclass
class DataCommon:
    """The keys every data source has; each source's schema (wandistiller/data/sources/<name>.py) adds its own, and
    its defaults live in conf/data/*.yaml."""

    # Prompts file, one per line; None = the prompts shipped with WanDistiller.
    prompts_path: str | None = MISSING
    # Student latents: 16 channels x frames x height x width (a 480x832 frame is 1 x 60 x 104).
    latent_frames: int = MISSING
    latent_height: int = MISSING
    latent_width: int = MISSING
    # The data source (wandistiller/data/sources/<name>.py): each source's schema allows its own name alone.
    latents: str = MISSING
    # Held-out prompts for validation, one per line; None = the last `val_fraction` of the prompts.
    val_prompts_path: str | None = None
    val_fraction: float = 0.1


@dataclass
class StudentConfig:
    # What builds the student: called with these keys plus the teacher's spec and a dtype (swap in your own).
    _target_: str = "wandistiller.student.model.build_student"
    # A named architecture (`wandistiller.core.arch`: STUDENT_BUILDERS, TEACHER_SHAPED_STUDENTS, PRUNED_STUDENTS), or
    # None with `config_path`.
    builder: str | None = None
    # A diffusers WanTransformer3DModel config.json (train_distillation.py's --student_config file).
    config_path: str | None = None
    # "teacher": cut from the teacher's weights (its head size, no larger: wandistiller/student/prune.py); "auto":
    # that when the student can be cut from the teacher, else "random"; or a WanTransformer3DModel folder to cut
    # it from (checked by wandistiller.student.model.check_student before anything loads).
    init: str = "auto"
    # Which source blocks a student started from weights keeps: "auto" (scored on calibration inputs, written to
    # the run's pruning.json), "even" (evenly spaced), or a list of block indices [0, 2, ...].
    keep_blocks: Any = "auto"
    # student=lora (wandistiller/student/lora.py) alone: the adapters' rank, their alpha (None: alpha = rank, a
    # scale of 1), and the Linear layers they adapt in every block ("all", "attention", "ffn", or a list of names).
    rank: int | None = None
    alpha: float | None = None
    layers: Any = None


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
    # The `loss` group's option, each with its own schema (wandistiller/recipe/losses/<name>.py): LossInputs ->
    # named parts, its `needs` deciding what a step computes.
    loss: Any = MISSING
    lr_scheduler: LrScheduler = MISSING
    # The LR schedule's length: None = max_steps. A resume keeps its first launch's (job/resumed.py), so another
    # trainer.max_steps stops the run earlier or later along the schedule it was made with, never reshapes it.
    schedule_steps: int | None = None
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


# Each hardware.* number's range, so a slip (hardware.gpus=-1, hardware.gpu_memory_gib=-40) is refused rather
# than planned: (lowest, highest, what the line says). The sizes are GiB; null (gpus and the memories) = detect.
HARDWARE_RANGES: dict[str, tuple[float, float, str]] = {
    "gpus": (0, 64, "in [0, 64] (GPUs per node), or null to detect this machine's"),
    "gpu_memory_gib": (0, 1024, "in [0, 1024] (GiB of one GPU), or null to detect this machine's"),
    "host_memory_gib": (0.5, 65536, "in [0.5, 65536] (GiB of host RAM per node), or null to detect this machine's"),
    "headroom_gib": (0, 1024, "in [0, 1024] (GiB left free on every device)"),
    "headroom_fraction": (0, 0.99, "in [0, 0.99] (the fraction of every device left free)"),
}


def hardware_problem(hardware) -> str | None:
    """The first `hardware.*` number outside its range (HARDWARE_RANGES), as one line naming the key; None if none."""
    for key, (lowest, highest, what) in HARDWARE_RANGES.items():
        value = hardware[key]
        if value is None and key not in ("headroom_gib", "headroom_fraction"):
            continue
        if value is None or not lowest <= value <= highest:  # NaN fails the comparison too
            return f"hardware.{key}={value} must be {what}"
    return None


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
    # Each data source has its own schema (DataCommon + its keys: wandistiller/data/sources/<name>.py).
    data: Any = MISSING
    student: StudentConfig = MISSING
    trainer: TrainerConfig = MISSING
    # The loggers by name (`logger=[wandb,tensorboard,csv]`), each with its own schema
    # (wandistiller/tracking/loggers/<name>.py); `logger=none`: none.
    logger: dict[str, Any] = field(default_factory=dict)
    # The loop's hooks by name (`hooks=[monitor,progress,samples,evaluate]`), each with its own schema and settings
    # (wandistiller/recipe/hooks/<name>.py: `hooks.monitor.val_every`, `hooks.samples.every`, ...).
    hooks: dict[str, Any] = field(default_factory=dict)
    # What one training step does (`method=kd|trajectory|dmd`), each with its own schema
    # (wandistiller/recipe/methods/<name>.py): `method.name`, and `method.steps` the K of a few-step student.
    method: Any = MISSING
    distributed: DistributedConfig = MISSING
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    paths: PathsConfig = MISSING
    # The recipe one process runs: setup() then train() (wandistiller.recipe.distillation.DistillationRecipe).
    recipe: Any = MISSING
    seed: int = 0
