"""The memory model: bytes a teacher, a student and their activations take, from configs alone.

Parameters are counted on the meta device (nothing is loaded), so the same arithmetic plans for
hardware you do not have. Each placement combines these terms into its own per-device estimate
(`Placement.estimate`); the planner (`wandistiller.plan`) compares the estimates with the hardware.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from dataclasses import dataclass

import torch

GiB = 2**30
CUDA_CONTEXT = int(0.6 * GiB)  # per process per GPU: CUDA context, cuBLAS workspaces, allocator slack
HOST_PER_RANK = 2 * GiB  # per process in host RAM: Python, torch, the libraries, small buffers
HEADROOM = 0.92  # plan to fill at most this share of a device


@dataclass(frozen=True)
class Hardware:
    gpu_bytes: tuple[int, ...]  # free memory per GPU on one node
    host_bytes: int  # available host RAM on one node

    @classmethod
    def detect(cls, hardware_cfg) -> Hardware:
        """The configured hardware (on paper) where `hardware.*` is set, else this machine's."""
        from wandistiller.errors import UserError

        if hardware_cfg.gpus is not None:
            if hardware_cfg.gpus > 0 and hardware_cfg.gpu_memory_gib is None:
                raise UserError(
                    f"hardware.gpus={hardware_cfg.gpus} plans on paper and needs the memory of each GPU too: "
                    "add hardware.gpu_memory_gib=<GiB per GPU> (e.g. 80)"
                )
            gpus = (int((hardware_cfg.gpu_memory_gib or 0) * GiB),) * hardware_cfg.gpus
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
    ranks_per_node: int = 1
    teacher_batch_size: int = 0  # samples per teacher call when not batch_size (trainer.teacher_whole_step)


@dataclass(frozen=True)
class Estimate:
    placement: str
    fits: bool
    gpu_bytes: tuple[int, ...]  # per GPU
    host_bytes: int
    note: str
    resident_blocks: int | None = None  # offload/disk on a GPU: blocks per expert kept there, not streamed

    @classmethod
    def of(
        cls, name: str, gpus: tuple[int, ...], host: int, hw: Hardware, note: str, resident_blocks: int | None = None
    ) -> Estimate:
        """An estimate that fits when every device keeps its headroom."""
        fits = all(need <= cap * HEADROOM for need, cap in zip(gpus, hw.gpu_bytes)) and host <= hw.host_bytes * HEADROOM
        return cls(name, fits, gpus, host, note, resident_blocks)

    @classmethod
    def refused(cls, name: str, why: str) -> Estimate:
        return cls(name, False, (), 0, why)

    def need(self) -> str:
        gpu = f"{max(self.gpu_bytes) / GiB:.1f} GiB on its fullest GPU, " if self.gpu_bytes else ""
        return f"{gpu}{self.host_bytes / GiB:.1f} GiB host RAM"


@functools.lru_cache(maxsize=16)
def _param_count(config_json: str) -> int:
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    with init_empty_weights():
        model = WanTransformer3DModel.from_config(json.loads(config_json))
    return sum(p.numel() for p in model.parameters())


def param_count(config: dict) -> int:
    return _param_count(json.dumps({k: v for k, v in config.items() if not k.startswith("_")}, sort_keys=True))


def width(c: dict) -> int:
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


def teacher_activation_bytes(w: Workload) -> int:
    """Inference keeps about one block's intermediates for the CFG pair (2x the batch)."""
    c, batch = w.teacher_config, w.teacher_batch_size or w.batch_size
    per_token = c["ffn_dim"] + 4 * width(c)
    return 2 * batch * (w.tokens * per_token + 2 * w.text_tokens * width(c)) * w.teacher_dtype_bytes


def student_bytes(w: Workload) -> int:
    """fp32 weights + grads + AdamW moments (+ EMA), and activations kept for backward (bf16)."""
    c = w.student_config
    params = param_count(c) * (16 + (4 if w.ema else 0))
    per_layer = w.batch_size * w.tokens * (10 * width(c) + 2 * c["ffn_dim"]) * 2
    layers = 1 if w.gradient_checkpointing else c["num_layers"]
    return params + per_layer * layers + c["num_layers"] * w.batch_size * w.tokens * width(c) * 2


def student_device_bytes(w: Workload) -> int:
    """A training rank's GPU: the student and its process's CUDA context."""
    return student_bytes(w) + CUDA_CONTEXT
