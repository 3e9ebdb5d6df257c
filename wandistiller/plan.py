"""The memory planner: bytes each placement needs on each device, and the fastest one that fits.

Estimates come from the teacher's config alone (parameters counted on the meta device, times the
dtype's size) plus activations for the batch, against the hardware: GPUs and their free memory, host
RAM, ranks per node. Nothing is loaded, so it also plans on paper for hardware you do not have:

    python -m wandistiller.plan teacher=wan2.2_t2v_a14b hardware.gpus=8 hardware.gpu_memory_gib=40
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from wandistiller.errors import UserError

GiB = 2**30
CUDA_CONTEXT = int(0.6 * GiB)  # per process per GPU: CUDA context, cuBLAS workspaces, allocator slack
HEADROOM = 0.92  # plan to fill at most this share of a device

# Transformer configs of the public Wan teachers, so plans need no download.
WAN_14B = dict(
    num_attention_heads=40,
    attention_head_dim=128,
    ffn_dim=13824,
    num_layers=40,
    text_dim=4096,
    in_channels=16,
    out_channels=16,
    patch_size=[1, 2, 2],
    freq_dim=256,
)
WAN_1_3B = WAN_14B | dict(num_attention_heads=12, ffn_dim=8960, num_layers=30)
KNOWN_TEACHERS = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": (WAN_1_3B, 1),
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": (WAN_14B, 1),
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": (WAN_14B, 2),
}
# Fastest first. A placement's rank here is the planner's whole notion of speed.
SPEED_ORDER = ["gpu", "gpu0", "balanced", "sequential", "sharded", "offload", "disk", "cpu"]


@dataclass(frozen=True)
class Hardware:
    gpu_bytes: tuple[int, ...]  # free memory per GPU on one node
    host_bytes: int  # available host RAM on one node

    @classmethod
    def detect(cls, hardware_cfg) -> Hardware:
        if hardware_cfg.gpus is not None:
            gpus = (int(hardware_cfg.gpu_memory_gib * GiB),) * hardware_cfg.gpus
        else:
            gpus = free_gpu_bytes()
        if hardware_cfg.host_memory_gib is not None:
            host = int(hardware_cfg.host_memory_gib * GiB)
        else:
            host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return cls(gpus, host)

    def describe(self) -> str:
        gpus = (
            f"{len(self.gpu_bytes)} GPU(s) of {min(self.gpu_bytes) / GiB:.0f} GiB free" if self.gpu_bytes else "no GPU"
        )
        return f"{gpus}, {self.host_bytes / GiB:.0f} GiB host RAM"


def free_gpu_bytes() -> tuple[int, ...]:
    """Free memory per visible GPU, read without creating a CUDA context in this process.

    The Hydra job plans before it launches workers; a context here would hold GPU memory for the whole
    sweep. nvidia-smi reports free memory; without it, the total is the best guess.
    """
    if not torch.cuda.is_available():  # asks the driver for a device count; creates no context
        return ()
    count = torch.cuda.device_count()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.split()
        free = [int(v) * 2**20 for v in out]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible and all(v.strip().isdigit() for v in visible.split(",")):
            free = [free[int(v)] for v in visible.split(",")]
        if len(free) >= count:
            return tuple(free[:count])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    return tuple(torch.cuda.get_device_properties(i).total_memory for i in range(count))


@dataclass(frozen=True)
class Workload:
    teacher_config: dict
    experts: int
    teacher_dtype_bytes: int
    student_config: dict
    batch_size: int  # per rank, per micro-batch
    tokens: int
    text_tokens: int
    gradient_checkpointing: bool
    ema: bool
    shared_host_copy: bool = True  # offload: one pinned copy per node (else one per rank)
    teacher_batch_size: int = 0  # samples per teacher call when not batch_size (trainer.teacher_whole_step)


@dataclass(frozen=True)
class Estimate:
    placement: str
    fits: bool
    gpu_bytes: tuple[int, ...]  # per GPU
    host_bytes: int
    note: str
    resident_blocks: int | None = None  # offload/disk on a GPU: blocks per expert kept there, not streamed


@functools.lru_cache(maxsize=16)
def _param_count(config_json: str) -> int:
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    with init_empty_weights():
        model = WanTransformer3DModel.from_config(json.loads(config_json))
    return sum(p.numel() for p in model.parameters())


def param_count(config: dict) -> int:
    return _param_count(json.dumps({k: v for k, v in config.items() if not k.startswith("_")}, sort_keys=True))


def _width(c: dict) -> int:
    return c["num_attention_heads"] * c["attention_head_dim"]


def block_bytes(config: dict, dtype_bytes: int) -> tuple[int, int]:
    """(bytes outside the blocks, bytes of one block) for one expert: what streaming keeps and moves."""
    outside = param_count(config | {"num_layers": 0})
    return outside * dtype_bytes, (param_count(config) - outside) // config["num_layers"] * dtype_bytes


def blocks_that_fit(config: dict, experts: int, dtype_bytes: int, budget: float) -> int:
    """Blocks per expert a streamed teacher can keep on a GPU with `budget` bytes for the teacher's
    weights: what is left after the parts that never stream and two streaming slots per expert."""
    outside, block = block_bytes(config, dtype_bytes)
    return max(0, min(config["num_layers"], int((budget - experts * (outside + 2 * block)) // (experts * block))))


def resident_blocks(config: dict, experts: int, dtype: torch.dtype, free_bytes: int) -> int:
    """The same when no plan says (a run uses the planner's count, which knows the student): 20% + 4 GiB
    of the free memory are left for the student and activations."""
    return blocks_that_fit(config, experts, torch.finfo(dtype).bits // 8, free_bytes * 0.8 - 4 * GiB)


def teacher_weight_bytes(w: Workload) -> int:
    return param_count(w.teacher_config) * w.teacher_dtype_bytes * w.experts


def teacher_activation_bytes(w: Workload, batch: int) -> int:
    """Inference keeps about one block's intermediates for the CFG pair (2x the batch)."""
    c = w.teacher_config
    per_token = c["ffn_dim"] + 4 * _width(c)
    return 2 * batch * (w.tokens * per_token + 2 * w.text_tokens * _width(c)) * w.teacher_dtype_bytes


def student_bytes(w: Workload) -> int:
    """fp32 weights + grads + AdamW moments (+ EMA), and activations kept for backward (bf16)."""
    c = w.student_config
    params = param_count(c) * (16 + (4 if w.ema else 0))
    per_layer = w.batch_size * w.tokens * (10 * _width(c) + 2 * c["ffn_dim"]) * 2
    layers = 1 if w.gradient_checkpointing else c["num_layers"]
    return params + per_layer * layers + c["num_layers"] * w.batch_size * w.tokens * _width(c) * 2


def estimate(name: str, w: Workload, hw: Hardware, ranks_per_node: int) -> Estimate:
    """Per-device bytes for one placement on one node."""
    n_gpu = len(hw.gpu_bytes)
    teacher, student = teacher_weight_bytes(w), student_bytes(w) + CUDA_CONTEXT
    act = teacher_activation_bytes(w, w.teacher_batch_size or w.batch_size)
    host_small = 2 * GiB
    gpus: tuple[int, ...] = ()
    host, note, kept = host_small, "", None
    if name == "cpu":
        gpus = (student,) * min(n_gpu, ranks_per_node)
        host = teacher + act + host_small * ranks_per_node
        note = "one teacher per node in host RAM, computing on the CPU"
    elif name == "sharded":
        if ranks_per_node < 2:
            return Estimate(name, False, (), 0, "needs 2 or more ranks")
        _, block = block_bytes(w.teacher_config, w.teacher_dtype_bytes)
        gpus = (teacher // ranks_per_node + 2 * block + act + student,) * min(n_gpu, ranks_per_node)
        # Loading is staggered (one full copy at a time); without a GPU the shards live in RAM.
        host = teacher + host_small * ranks_per_node + (0 if n_gpu else ranks_per_node * (2 * block + act))
        note = f"FSDP2 shards over {ranks_per_node} ranks, gathering a block at a time"
    elif name == "disk" and n_gpu == 0:
        outside, block = block_bytes(w.teacher_config, w.teacher_dtype_bytes)
        host = w.experts * (outside + 2 * block) + act + host_small * ranks_per_node
        note = "safetensors on disk -> RAM, one block ahead, computing on the CPU"
    elif n_gpu == 0:
        return Estimate(name, False, (), 0, "needs a GPU")
    elif name == "gpu":
        gpus = (teacher + act + student,) * min(n_gpu, ranks_per_node)
        note = "a full teacher on every rank's GPU"
    elif name == "gpu0":
        if n_gpu < 2:
            return Estimate(name, False, (), 0, "needs 2 or more GPUs")
        students = max(min(n_gpu, ranks_per_node) - 1, 1)
        gpus = (teacher + act + CUDA_CONTEXT,) + (student,) * students
        note = f"teacher on GPU 0, {students} student rank(s) on GPUs 1..{students}"
    elif name in ("balanced", "sequential"):
        used = min(n_gpu, max(ranks_per_node, 1)) if name == "balanced" else n_gpu
        share = [teacher // n_gpu] * n_gpu
        if name == "sequential":  # fill GPU 0 first, then the next
            share, left = [], teacher
            for cap in hw.gpu_bytes:
                take = max(min(left, int(cap * HEADROOM) - student - act), 0)
                share.append(take)
                left -= take
            share[-1] += left
        gpus = tuple(s + (act if i == 0 else 0) + (student if i < used else 0) for i, s in enumerate(share))
        note = f"one teacher per node spread over {n_gpu} GPU(s)" if name == "balanced" else "fills GPU 0 first"
    elif name in ("offload", "disk"):
        outside, block = block_bytes(w.teacher_config, w.teacher_dtype_bytes)
        # The GPU memory left over keeps the first blocks resident: fewer bytes to stream per forward.
        budget = min(hw.gpu_bytes) * HEADROOM - act - student
        kept = blocks_that_fit(w.teacher_config, w.experts, w.teacher_dtype_bytes, budget)
        streaming = w.experts * (outside + (2 + kept) * block) + act + student  # two device slots per expert
        gpus = (streaming,) * min(n_gpu, ranks_per_node)
        if name == "offload":
            copies = 1 if w.shared_host_copy else ranks_per_node
            host = teacher * copies + (block + host_small) * ranks_per_node
            note = "pinned RAM -> GPU, one block ahead, " + ("a copy per node" if copies == 1 else "a copy per rank")
        else:
            host = (2 * block + host_small) * ranks_per_node
            note = "safetensors on disk -> GPU, one block ahead"
        note += f"; {kept}/{w.teacher_config['num_layers']} blocks resident"
    else:
        raise UserError(f"teacher_placement={name} has no memory estimate; choose one of {', '.join(SPEED_ORDER)}")
    fits = all(need <= cap * HEADROOM for need, cap in zip(gpus, hw.gpu_bytes)) and host <= hw.host_bytes * HEADROOM
    return Estimate(name, fits, gpus, host, note, resident_blocks=kept)


def plan(w: Workload, hw: Hardware, ranks_per_node: int) -> list[Estimate]:
    order = list(SPEED_ORDER)
    if not hw.gpu_bytes:  # without a GPU, streaming from disk to the CPU is the slowest way, not the 2nd
        order.append(order.pop(order.index("disk")))
    return [estimate(name, w, hw, ranks_per_node) for name in order]


def choose(estimates: list[Estimate]) -> Estimate | None:
    return next((e for e in estimates if e.fits), None)


def format_table(estimates: list[Estimate], hw: Hardware, chosen: str | None = None) -> str:
    rows = [
        f"hardware: {hw.describe()}",
        f"{'placement':<11} {'fits':<5} {'peak GPU GiB (per device)':<34} host GiB  note",
    ]
    for e in estimates:
        gpu = ", ".join(f"{b / GiB:.1f}" for b in e.gpu_bytes) or "-"
        gpu = gpu if len(gpu) <= 32 else gpu[:29] + "..."
        mark = " <- chosen" if e.placement == chosen else ""
        rows.append(
            f"{e.placement:<11} {'yes' if e.fits else 'no':<5} {gpu:<34} {e.host_bytes / GiB:<9.1f} {e.note}{mark}"
        )
    return "\n".join(rows)


def planning_teacher_config(teacher_cfg) -> tuple[dict, int] | None:
    """(transformer config, experts) from a local folder's JSON or the known public teachers; None if neither."""
    path = Path(str(teacher_cfg.path)).expanduser()
    if (path / "transformer" / "config.json").is_file():
        index = json.loads((path / "model_index.json").read_text()) if (path / "model_index.json").is_file() else {}
        experts = 2 if (index.get("transformer_2") or [None])[-1] else 1
        return json.loads((path / "transformer" / "config.json").read_text()), experts
    if teacher_cfg.builtin is not None:
        from wandistiller.tiny_teacher import TINY_TRANSFORMER

        return dict(TINY_TRANSFORMER), 2 if teacher_cfg.builtin == "tiny_moe" else 1
    return KNOWN_TEACHERS.get(str(teacher_cfg.path))


def workload(cfg, teacher_config: dict, experts: int, teacher_dtype: torch.dtype) -> Workload:
    from wandistiller.student import student_config

    pt, ph, pw = teacher_config.get("patch_size", [1, 2, 2])
    d = cfg.data
    return Workload(
        teacher_config=teacher_config,
        experts=experts,
        teacher_dtype_bytes=torch.finfo(teacher_dtype).bits // 8,
        student_config=student_config(cfg.student, teacher_config),
        batch_size=cfg.trainer.batch_size,
        tokens=(d.latent_frames // pt) * (d.latent_height // ph) * (d.latent_width // pw),
        text_tokens=cfg.teacher.max_sequence_length,
        gradient_checkpointing=cfg.trainer.gradient_checkpointing,
        ema=cfg.trainer.ema_decay is not None,
        shared_host_copy=cfg.teacher_placement.share_host_copy,
        teacher_batch_size=cfg.trainer.batch_size
        * (cfg.trainer.grad_accum_steps if cfg.trainer.teacher_whole_step else 1),
    )


def ranks_per_node(cfg, hw: Hardware) -> int:
    """The configured ranks per node; on paper (one process configured), one rank per GPU."""
    if cfg.distributed.nproc_per_node > 1:
        return cfg.distributed.nproc_per_node
    return max(len(hw.gpu_bytes), 1) if cfg.hardware.gpus is not None else 1


def main() -> None:
    """Compose the same config tree as training (no run folder, no log file) and print the plan."""
    import sys

    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from wandistiller.config import register_configs
    from wandistiller.errors import exit_on_user_error
    from wandistiller.precision import Precision

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base=None):
            cfg = compose("train", overrides=sys.argv[1:])
    except (HydraException, OmegaConfBaseException) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    with exit_on_user_error():
        print(plan_report(cfg, Precision.from_config(cfg.precision).teacher_dtype))


def plan_report(cfg, teacher_dtype: torch.dtype) -> str:
    found = planning_teacher_config(cfg.teacher)
    if found is None:
        raise UserError(f"teacher.path={cfg.teacher.path!r}: no local config.json to plan from; download it first")
    hw = Hardware.detect(cfg.hardware)
    w = workload(cfg, *found, teacher_dtype)
    estimates = plan(w, hw, ranks_per_node(cfg, hw))
    best = choose(estimates)
    head = (
        f"teacher {cfg.teacher.name}: {found[1]} expert(s), {teacher_weight_bytes(w) / GiB:.1f} GiB of weights; "
        f"student {param_count(w.student_config) / 1e6:.0f}M params; batch {w.batch_size} x {w.tokens} tokens"
    )
    tail = f"auto would choose: {best.placement}" if best else "nothing fits: use smaller dtypes or more memory"
    return "\n".join([head, format_table(estimates, hw, best.placement if best else None), tail])


if __name__ == "__main__":
    main()
