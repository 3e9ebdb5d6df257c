"""Schemas for the Hydra config tree.

One dataclass per config group, registered in Hydra's ConfigStore as `train_schema` and listed first in
`conf/train.yaml`'s defaults. Every YAML option then merges into a typed node, so a typo in a key or a
value of the wrong type fails at composition with Hydra's own message, before anything heavy loads.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


@dataclass
class TeacherConfig:
    name: str = MISSING
    # A local diffusers-format Wan folder or a Hub id.
    path: str = MISSING
    # "tiny" / "tiny_moe": build this embedded teacher at `path` when it is not there yet.
    builtin: str | None = None
    guidance_scale: float = 5.0
    # Two-expert teachers: CFG scale of the low-noise expert (`transformer_2`); None = guidance_scale.
    guidance_scale_2: float | None = None
    negative_prompt: str = ""
    max_sequence_length: int = 512
    # Shift of the flow schedule training timesteps are drawn from; None = the teacher scheduler's.
    flow_shift: float | None = None
    # Regional torch.compile of the teacher's blocks (one graph reused by all); placements that run a
    # whole teacher in one process only (cpu, gpu, gpu0, offload, disk).
    compile: bool = False
    # "fp8": torchao float8 dynamic quantization of the blocks' Linear layers (Hopper+; wandistiller.fastpaths).
    quantize: str | None = None
    # diffusers attention backend for the teacher ("flash", "_native_cudnn", ...); None = diffusers' default.
    attention_backend: str | None = None


@dataclass
class PlacementConfig:
    _target_: str = MISSING
    # gpu0: the teacher's process also trains a student on GPU 0.
    train_on_owner: bool = False
    # gpu0 / balanced / sequential / device_map: keep the process layout, put the teacher on the CPU.
    debug_cpu: bool = False
    # balanced / sequential / device_map: accelerate's device_map ("balanced", "sequential" or a dict).
    strategy: Any = None
    # balanced / sequential / device_map: per-GPU caps, e.g. {0: 20GiB, 1: 70GiB}.
    max_memory: Any = None
    # offload / disk: where the weights stream from ("host" RAM or "disk"), and how many blocks stay resident.
    source: str | None = None
    resident_blocks: Any = "auto"
    # offload: a node's ranks share one pinned copy of the teacher (through /dev/shm) instead of one each.
    share_host_copy: bool = True
    # disk: where a teacher stored in a wider dtype than it computes in is converted once (null: convert
    # each block as it streams).
    offload_dir: str | None = None


@dataclass
class PrecisionConfig:
    name: str = MISSING
    teacher_dtype: str = MISSING
    student_dtype: str = "fp32"
    autocast_dtype: str | None = None


@dataclass
class DataConfig:
    # Prompts file, one per line; None = the prompts shipped with WanDistiller.
    prompts_path: str | None = None
    # Student latents: 16 channels x frames x height x width (a 480x832 frame is 1 x 60 x 104).
    latent_frames: int = 1
    latent_height: int = 8
    latent_width: int = 8
    # How clean latents x0 are made: "gaussian" (data-free distillation).
    latents: str = "gaussian"


@dataclass
class StudentConfig:
    # A named architecture from `wandistiller.student.STUDENT_BUILDERS`, or None with `config_path`.
    builder: str | None = None
    # A diffusers WanTransformer3DModel config.json (the old student_config.json).
    config_path: str | None = None
    # "random", or "teacher": copy embeddings and evenly spaced blocks (widths must match).
    init: str = "random"
    # Weight of hidden-state distillation through a learned student->teacher width projection; 0 = off.
    hidden_kd_weight: float = 0.0


@dataclass
class TrainerConfig:
    batch_size: int = 4
    grad_accum_steps: int = 1
    # One teacher call for all of a step's micro-batches (a streamed teacher then moves its weights once
    # per step, not once per micro-batch); targets equal to rounding. Ranks that run their own teacher.
    teacher_whole_step: bool = False
    max_steps: int = 100
    optimizer: Any = field(
        default_factory=lambda: {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-4, "weight_decay": 0.0}
    )
    lr_scheduler: str = "cosine"
    warmup_steps: int = 0
    max_grad_norm: float | None = 1.0
    gradient_checkpointing: bool = False
    # Regional torch.compile of the student's repeated blocks.
    compile_student: bool = False
    # torch.compile mode for the student's blocks: None (default), "reduce-overhead" (CUDA graphs), "max-autotune".
    compile_mode: str | None = None
    ema_decay: float | None = None
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    # None: a new run; "auto": continue the latest checkpoint in the run folder; or a checkpoint folder.
    resume: str | None = None
    log_every: int = 1
    progress_bar: bool = True
    # The teacher-vs-student PNG grid at the end: prompts shown and sampling steps; 0 prompts = skip.
    sample_prompts: int = 4
    sample_steps: int = 10


@dataclass
class LoggerConfig:
    _target_: str = MISSING
    project: str = "wandistiller"
    entity: str | None = None
    # "offline" (default: no network), "online", or "disabled".
    mode: str = "offline"
    group: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)


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


@dataclass
class PathsConfig:
    cache_dir: str = MISSING
    output_dir: str = MISSING


@dataclass
class TrainConfig:
    teacher: TeacherConfig = MISSING
    teacher_placement: PlacementConfig = MISSING
    precision: PrecisionConfig = MISSING
    data: DataConfig = MISSING
    student: StudentConfig = MISSING
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = MISSING
    distributed: DistributedConfig = MISSING
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    paths: PathsConfig = MISSING
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
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    OmegaConf.register_new_resolver("wd_now", shared_now, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("wd_rank_suffix", rank_suffix, replace=True)
