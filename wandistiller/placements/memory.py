"""The memory model: bytes a teacher, a student and their activations take, from configs alone.

Parameters are counted on the meta device (nothing is loaded), so the same arithmetic plans for
hardware you do not have. Each placement combines these terms into its own per-device estimate
(`Placement.estimate`); the planner (`wandistiller.plan`) compares the estimates with the hardware.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import subprocess
from dataclasses import dataclass

import torch

from wandistiller.core.errors import UserError
from wandistiller.teacher.fp8 import eligible
from wandistiller.teacher.lora import targets

GiB = 2**30
# The calibrated model's constants. "measured": read off a run; "fitted": a factor on a physical count,
# fitted to measured peaks by scripts/fit_planner.py (data and residuals in docs/planner_fit.json, method in
# docs/PLANNER.md); "extrapolated": not yet checked against any measurement.
HOST_BASE = int(0.42 * GiB)  # measured: a training job's RSS with tiny models (Python, torch, diffusers, Hydra)
HOST_CUDA = int(1.6 * GiB)  # extrapolated: host RSS the CUDA runtime adds per process (its libraries, kernels)
CUDA_CONTEXT = int(0.6 * GiB)  # extrapolated: per process per GPU, the context and cuBLAS workspaces
# Saved activations per token and block under bf16 autocast, bytes = ACT_PER_D * width + ACT_PER_FFN * ffn_dim:
# measured on the CPU with autograd's saved-tensor hooks on diffusers' WanTransformerBlock (width 1536).
ACT_PER_D, ACT_PER_FFN, ACT_TEXT_PER_D = 68, 4, 12
# extrapolated (a physical count): what LoRA adapters (teacher/lora.py) add to a block's saved tensors, per token:
# the 16-bit input each adapted Linear's A keeps under autocast (each hook casts its own: q, k, v, out and the FFN's
# two) and its rank-wide A x (negligible). Per image token x width: attn1's 4 + attn2's q and out + ffn.net.0's 1
# input, 2 bytes each; x ffn_dim: ffn.net.2's; per text token x width: attn2's k and v.
ACT_LORA_PER_D, ACT_LORA_PER_FFN, ACT_LORA_TEXT_PER_D = 14, 2, 4
# Per token outside the blocks: patch embedding, output norm and head (x width), and the fp32 latents,
# noise, targets and loss terms (x channels x patch); measured the same way.
ACT_OUTSIDE_PER_D, ACT_LATENT_PER_VALUE = 24, 32
# fitted (GPU): see docs/planner_fit.json. "gpu_adapted": a backward through the 16-bit teacher to adapters on it
# (a LoRA student or fake score), whose saved tensors are 16-bit where an autocast student keeps fp32 ones.
ACT_FACTOR = {"cpu": 1.0, "gpu": 0.95, "gpu_compiled": 0.56, "gpu_adapted": 0.61, "gpu_adapted_compiled": 0.51}
# fitted: bytes per image token and per text token that glibc's heap keeps on the CPU beyond the physical count
CPU_HEAP_PER_TOKEN = (1720, 1228)
FIT_ERROR_PCT = 13  # fitted: predictions lie 0 to this % above the measured peaks (the plan table's error bar)
# Planned on top of a process's fitted bytes (not the teacher's weights, which are exact), so a prediction
# lands above its measurement (the target: 0 to +15%) rather than around it.
FIT_MARGIN = 0.05
DEFAULT_HEADROOM_FRACTION = 0.08  # of each device, left free unless hardware.headroom_* say otherwise


@dataclass(frozen=True)
class Hardware:
    gpu_bytes: tuple[int, ...]  # free memory per GPU on one node
    host_bytes: int  # available host RAM on one node
    # Left free on every device (GPU and host): the larger of the two, hardware.headroom_gib/_fraction.
    headroom_gib: float = 0.0
    headroom_fraction: float = DEFAULT_HEADROOM_FRACTION
    # /dev/shm's size on one node (RAM-backed): where offload's ranks share one pinned copy. None: not known.
    shm_bytes: int | None = None

    @classmethod
    def detect(cls, hardware_cfg) -> Hardware:
        """The configured hardware (on paper) where `hardware.*` is set, else this machine's."""

        if hardware_cfg.gpus is not None:
            if hardware_cfg.gpus > 0 and hardware_cfg.gpu_memory_gib is None:
                raise UserError(
                    f"hardware.gpus={hardware_cfg.gpus} plans on paper and needs the memory of each GPU too: "
                    "add hardware.gpu_memory_gib=<GiB per GPU> (e.g. 80)"
                )
            if hardware_cfg.gpus == 0 and hardware_cfg.gpu_memory_gib:
                raise UserError(
                    f"hardware.gpu_memory_gib={hardware_cfg.gpu_memory_gib:g} is one GPU's memory, but "
                    "hardware.gpus=0 plans no GPU; set hardware.gpus=1 (or more) to plan with it, or drop it"
                )
            gpus = (int((hardware_cfg.gpu_memory_gib or 0) * GiB),) * hardware_cfg.gpus
        else:
            gpus = free_gpu_bytes()
            if hardware_cfg.gpu_memory_gib is not None:  # this machine's GPUs, with another size: not a plan of either
                raise UserError(
                    f"hardware.gpu_memory_gib={hardware_cfg.gpu_memory_gib:g} plans GPUs on paper, and needs their "
                    f"count too (this machine has {len(gpus)}): add hardware.gpus=<GPUs per node> (e.g. 1)"
                )
        if hardware_cfg.host_memory_gib is not None:
            host = int(hardware_cfg.host_memory_gib * GiB)
        else:
            host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        headroom = (hardware_cfg.headroom_gib, hardware_cfg.headroom_fraction)
        if headroom[0] < 0 or not 0 <= headroom[1] < 1:
            raise UserError(
                f"hardware.headroom_gib={headroom[0]} / hardware.headroom_fraction={headroom[1]}: use a size >= 0 "
                "and a fraction in [0, 1)"
            )
        return cls(gpus, host, *headroom, shm_bytes=shm_size(hardware_cfg.host_memory_gib))

    def headroom(self, capacity: int) -> int:
        """Bytes of a device of `capacity` the planner leaves free."""
        return int(max(self.headroom_gib * GiB, self.headroom_fraction * capacity))

    def usable(self, capacity: int) -> int:
        return capacity - self.headroom(capacity)

    def describe(self) -> str:
        gpus = (
            f"{len(self.gpu_bytes)} GPU(s) of {min(self.gpu_bytes) / GiB:.0f} GiB free" if self.gpu_bytes else "no GPU"
        )
        return f"{gpus}, {self.host_bytes / GiB:.0f} GiB host RAM available"  # free now (or as planned on paper)

    def describe_headroom(self) -> str:
        return f"headroom: the larger of {self.headroom_gib:g} GiB and {self.headroom_fraction:.0%} of each device"


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


# The shapes a method's own network can take (OwnNetwork.shape).
STUDENT_SHAPED, TEACHER_SHAPED, ADAPTERS = "student", "teacher", "adapters"


@dataclass(frozen=True)
class OwnNetwork:
    """A network a method trains beside the student, as the method declares it (`Method.passes`) and the planner
    counts it, so that a new method's network is planned with no edit here:

    shape     "student": a copy of the student (a LoRA student's: a second adapter set of its rank and layers on the
              placed teacher); "teacher": teacher-shaped, on the training device (from the whole teacher there);
              "adapters": low-rank adapters of rank `rank` on the placed teacher (a backward through it)
    forwards  its passes without grad in one step of one rank, at the micro-batch
    trains    its forward + backward passes in that step
    state_bytes_per_param   its fp32 weights and its optimizer's states (AdamW: 4 + 8), grads aside
    key       the setting that chose it, as the plan and its refusals name it (`method.fake_score=lora`)
    """

    name: str
    key: str
    shape: str
    rank: int = 0
    forwards: float = 0.0
    trains: float = 0.0
    state_bytes_per_param: int = 12

    def __post_init__(self) -> None:
        if self.shape not in (STUDENT_SHAPED, TEACHER_SHAPED, ADAPTERS):
            raise ValueError(f"OwnNetwork.shape={self.shape!r}: one of student, teacher, adapters")


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
    autocast: bool = True  # the student runs under bf16/fp16 autocast (false: fp32 activations)
    compiled: bool = False  # trainer.compile_student: regional torch.compile of the student's blocks
    # teacher.compile: the teacher's blocks, and so the adapters on them (a LoRA student's, a LoRA fake score's)
    teacher_compiled: bool = False
    teacher_fp8: bool = False  # teacher.quantize=fp8: the blocks' Linear weights in 1 byte + a scale per row
    # The networks the method trains beside the student, as it declares them (`Method.passes`: dmd's fake score).
    networks: tuple[OwnNetwork, ...] = ()
    # student=lora: the student is the placed teacher with trainable adapters of this rank on every expert (its
    # student_config is the teacher's); 0: a network of its own.
    student_lora_rank: int = 0
    student_lora_layers: tuple[str, ...] | None = None  # its adapted Linears in each block (None: all of them)
    # Set by the placement: a backward through its teacher is checkpointed per block (offload, disk:
    # streaming.Recomputed), so an adapted network keeps each block's input and one block's activations.
    teacher_checkpointed: bool = False


@dataclass(frozen=True)
class Estimate:
    placement: str
    fits: bool
    gpu_bytes: tuple[int, ...]  # per GPU
    host_bytes: int
    note: str
    resident_blocks: int | None = None  # offload/disk on a GPU: blocks per expert kept there, not streamed
    # Why it does not fit although the memory alone would hold it: the headroom's numbers (else "").
    headroom_excludes: str = ""

    @classmethod
    def of(
        cls, name: str, gpus: tuple[int, ...], host: int, hw: Hardware, note: str, resident_blocks: int | None = None
    ) -> Estimate:
        """An estimate that fits when every device keeps its headroom."""
        devices = [(f"GPU {i}", need, cap) for i, (need, cap) in enumerate(zip(gpus, hw.gpu_bytes))]
        devices.append(("host RAM", host, hw.host_bytes))
        over = [(d, need, cap) for d, need, cap in devices if need > hw.usable(cap)]
        why = ""
        if over and all(need <= cap for _, need, cap in over):
            d, need, cap = over[0]
            why = (
                f"needs {need / GiB:.1f} GiB on {d}, and {cap / GiB:.1f} GiB free less {hw.headroom(cap) / GiB:.1f} "
                f"GiB headroom leaves {hw.usable(cap) / GiB:.1f}"
            )
        return cls(name, not over, gpus, host, note, resident_blocks, why)

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


@functools.lru_cache(maxsize=16)
def _fp8_counts(config_json: str) -> tuple[int, int]:
    """(weights, output rows) of one block's fp8 layers (wandistiller.teacher.fp8's choice, on a meta skeleton)."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    with init_empty_weights():
        model = WanTransformer3DModel.from_config(json.loads(config_json) | {"num_layers": 1})
    layers = [m for n, m in model.named_modules() if eligible(n, m)]
    return sum(m.weight.numel() for m in layers), sum(m.out_features for m in layers)


def block_bytes(config: dict, dtype_bytes: int, fp8: bool = False) -> tuple[int, int]:
    """(bytes outside the blocks, bytes of one block) for one expert: what streaming keeps and moves. With
    `fp8` the blocks' Linear weights take 1 byte each plus a float32 scale per output row."""
    outside = param_count(config | {"num_layers": 0})
    block = (param_count(config) - outside) // config["num_layers"] * dtype_bytes
    if fp8:
        weights, rows = _fp8_counts(json.dumps({k: v for k, v in config.items() if not k.startswith("_")}))
        block -= weights * (dtype_bytes - 1) - rows * 4
    return outside * dtype_bytes, block


def blocks_that_fit(config: dict, experts: int, dtype_bytes: int, budget: float, fp8: bool = False) -> int:
    """Blocks per expert a streamed teacher can keep on a GPU with `budget` bytes for the teacher's
    weights: what is left after the parts that never stream and two streaming slots per expert."""
    outside, block = block_bytes(config, dtype_bytes, fp8)
    return max(0, min(config["num_layers"], int((budget - experts * (outside + 2 * block)) // (experts * block))))


def resident_blocks(config: dict, experts: int, dtype: torch.dtype, free_bytes: int, fp8: bool = False) -> int:
    """The same when no plan says (a run uses the planner's count, which knows the student): 20% + 4 GiB
    of the free memory are left for the student and activations."""
    return blocks_that_fit(config, experts, torch.finfo(dtype).bits // 8, free_bytes * 0.8 - 4 * GiB, fp8)


def teacher_weight_bytes(w: Workload) -> int:
    outside, block = block_bytes(w.teacher_config, w.teacher_dtype_bytes, w.teacher_fp8)
    return (outside + block * w.teacher_config["num_layers"]) * w.experts


def teacher_activation_bytes(w: Workload) -> int:
    """The teacher's transient forward (no grad) at twice the batch (cond + uncond): the widest moment of a
    block -- the residual in fp32 beside its norm, q/k/v and the FFN's input, hidden and GELU output --
    plus the text's keys and values. A physical count, not yet checked against a measured peak."""
    c, batch = w.teacher_config, w.teacher_batch_size or w.batch_size
    per_token = 2 * c["ffn_dim"] + 8 * width(c)
    return 2 * batch * (w.tokens * per_token + 2 * w.text_tokens * width(c)) * w.teacher_dtype_bytes


def student_params(w: Workload) -> int:
    """The student's trainable parameters: its network's, or a LoRA student's adapters alone (student=lora: the
    teacher's weights are the placement's, no copy of them is the student's)."""
    if w.student_lora_rank:
        return lora_params(w, w.student_lora_rank, w.student_lora_layers)
    return param_count(w.student_config)


def student_state_bytes(w: Workload, grads: bool = True) -> int:
    """fp32 master weights, AdamW's two moments (+ EMA), and the fp32 grads while they exist (backward to step)."""
    per_param = 12 + (4 if grads else 0) + (4 if w.ema else 0)
    return student_params(w) * per_param


def network_config(w: Workload, n: OwnNetwork) -> dict:
    """The shape a method's own network computes at: the student's, or the teacher's (teacher-shaped, or adapters
    on the placed teacher: their forward and backward are the teacher's)."""
    return w.student_config if n.shape == STUDENT_SHAPED else w.teacher_config


def adapted(w: Workload, n: OwnNetwork) -> bool:
    """Whether the network is adapters on the placed teacher: adapters, or a copy of a LoRA student."""
    return n.shape == ADAPTERS or (n.shape == STUDENT_SHAPED and w.student_lora_rank > 0)


@functools.lru_cache(maxsize=16)
def _adapters_per_block(config_json: str, rank: int, layers: tuple[str, ...] | None = None) -> int:
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    with init_empty_weights():
        model = WanTransformer3DModel.from_config(json.loads(config_json) | {"num_layers": 1})
    adapted = [m for name, m in targets(model) if layers is None or name.split(".", 2)[2] in layers]
    return sum(rank * (m.in_features + m.out_features) for m in adapted)


def lora_params(w: Workload, rank: int, layers: tuple[str, ...] | None = None) -> int:
    """Rank-`rank` adapters on every block of every expert of the teacher: on teacher/lora.py's layers, or on those
    of them named in `layers` (`attn1.to_q`, ..., `ffn.net.2`)."""
    config = w.teacher_config
    config_json = json.dumps({k: v for k, v in config.items() if not k.startswith("_")}, sort_keys=True)
    return _adapters_per_block(config_json, rank, layers) * config["num_layers"] * w.experts


def network_params(w: Workload, n: OwnNetwork) -> int:
    """A method's network's trainable parameters: a whole network's, or adapters alone (on every block of every
    expert: teacher/lora.py), a LoRA student's copy at the student's rank and layers."""
    if n.shape == ADAPTERS:
        return lora_params(w, n.rank)
    if n.shape == STUDENT_SHAPED:
        return student_params(w)
    return param_count(network_config(w, n))


def method_state_bytes(w: Workload, training: OwnNetwork | None = None) -> int:
    """The method's own networks (dmd's fake score): each one's weights and optimizer states, + the fp32 grads of
    the one `training` (its own updates; set_to_none frees them before the student's); adapters alone where they are
    adapters (the teacher's weights are the placement's). 0 without any (kd, trajectory)."""
    held = sum(network_params(w, n) * n.state_bytes_per_param for n in w.networks)
    return held + (network_params(w, training) * 4 if training is not None else 0)


def network_activation_bytes(w: Workload, n: OwnNetwork, device: str = "gpu") -> int:
    """What a method's network's forward keeps for its backward, as the student's at its shape; adapters' is a
    backward through the placed teacher (`adapted_activation_bytes`)."""
    if adapted(w, n):
        return adapted_activation_bytes(w, device)
    # a network of its own (beside a LoRA student too: a teacher-shaped copy trains every weight of its own)
    whole = dataclasses.replace(w, student_config=network_config(w, n), ema=False, student_lora_rank=0)
    return student_activation_bytes(whole, device)


def adapted_activation_bytes(w: Workload, device: str = "gpu") -> int:
    """A backward through the placed teacher to adapters on it (a LoRA student, a LoRA fake score) at the student's
    batch: the teacher-shaped forward's saved tensors, with no 16-bit copies of weights that already compute in 16
    bits, plus the adapters' own. Checkpointed per block where the placement recomputes its blocks in backward
    (offload, disk: each block's input and one block's activations, the adapters as they were); all of them on a
    resident teacher (cpu, gpu: its modules are not checkpointed)."""
    c, n, s = w.teacher_config, w.batch_size * w.tokens, w.batch_size * w.text_tokens
    as_teacher = dataclasses.replace(
        w,
        student_config=c,
        student_lora_rank=0,
        ema=False,
        compiled=False,
        gradient_checkpointing=w.teacher_checkpointed,
    )
    factor = ACT_FACTOR["cpu" if device == "cpu" else "gpu_adapted_compiled" if w.teacher_compiled else "gpu_adapted"]
    plain = student_activation_bytes(as_teacher, device, weight_casts=w.teacher_dtype_bytes > 2, factor=factor)
    live = 1 if w.teacher_checkpointed else c["num_layers"]
    d = width(c)
    lora = n * (ACT_LORA_PER_D * d + ACT_LORA_PER_FFN * c["ffn_dim"]) + s * ACT_LORA_TEXT_PER_D * d
    return plain + int(factor * live * lora * (1 if w.autocast else 2))


def student_activation_bytes(
    w: Workload, device: str = "gpu", weight_casts: bool = True, factor: float | None = None
) -> int:
    """What the student's forward keeps for backward: each block's saved tensors per token (image and text),
    what lies outside the blocks, and under autocast the bf16 copy of every weight (`weight_casts=False`: weights
    already in 16 bits). With gradient checkpointing only each block's input is kept, plus one block being
    recomputed. Times the fitted factor of that device (`ACT_FACTOR`): CPU, GPU eager, GPU with regional compile
    (`factor`: another one, e.g. a backward through the teacher's).
    A LoRA student's: a backward through the placed teacher (`adapted_activation_bytes`)."""
    if w.student_lora_rank:
        return adapted_activation_bytes(w, device)
    c, n, s = w.student_config, w.batch_size * w.tokens, w.batch_size * w.text_tokens
    # Without autocast the blocks' bf16 tensors (48 of the 68 x width bytes) are fp32: 1.7x the block's bytes.
    d, scale = width(c), 1 if w.autocast else 1.7
    block = n * (ACT_PER_D * d + ACT_PER_FFN * c["ffn_dim"]) + s * ACT_TEXT_PER_D * d
    blocks = c["num_layers"] * block
    if w.gradient_checkpointing:
        blocks = block + c["num_layers"] * (n * 2 * d)
    patch = c.get("out_channels", 16) * math.prod(c.get("patch_size", (1, 2, 2)))
    # Text outside the blocks: the fp32 cond/uncond embeddings of the batch, the text projection's tensors.
    outside = n * (ACT_OUTSIDE_PER_D * d + ACT_LATENT_PER_VALUE * patch) + s * (10 * c.get("text_dim", 4096) + 6 * d)
    casts = param_count(c) * 2 if w.autocast and weight_casts else 0
    if factor is None:
        factor = ACT_FACTOR["gpu_compiled" if w.compiled and device == "gpu" else device]
    heap = n * CPU_HEAP_PER_TOKEN[0] + s * CPU_HEAP_PER_TOKEN[1] if device == "cpu" else 0
    return int(factor * (scale * blocks + outside + casts) + heap)


def training_bytes(w: Workload, device: str = "gpu", teacher_here: bool = True) -> int:
    """A training process's peak on `device` for the student: the larger of its two phases -- the teacher's
    transient forward (if it runs here) beside the weights and moments, or the student's forward and
    backward, with its saved activations and grads (`zero_grad(set_to_none=True)` frees grads between); with a
    method's own networks (dmd's fake score) their weights and optimizer states in every phase, and a phase for each
    network's own update."""
    own = method_state_bytes(w)
    student = student_state_bytes(w) + student_activation_bytes(w, device) + own
    teacher = student_state_bytes(w, grads=False) + (teacher_activation_bytes(w) if teacher_here else 0) + own
    phases = [student, teacher]
    for n in w.networks:  # each network's own update: its forward and backward on the student's samples
        phases.append(
            student_state_bytes(w, grads=False) + method_state_bytes(w, n) + network_activation_bytes(w, n, device)
        )
    return int(max(phases) * (1 + FIT_MARGIN))


def student_device_bytes(w: Workload) -> int:
    """A training rank's GPU when the teacher runs elsewhere: the student and its process's CUDA context."""
    return training_bytes(w, "gpu", teacher_here=False) + CUDA_CONTEXT


def beside_teacher_bytes(w: Workload) -> int:
    """A GPU that trains the student and runs the teacher's forward (gpu, offload, disk, sharded), less the
    teacher's weights."""
    return training_bytes(w, "gpu", teacher_here=True) + CUDA_CONTEXT


def host_process_bytes(hw: Hardware) -> int:
    """One process's host RSS before its models: the interpreter and libraries, and the CUDA runtime's."""
    return int(HOST_BASE * (1 + FIT_MARGIN)) + (HOST_CUDA if hw.gpu_bytes else 0)


def host_training_bytes(w: Workload, hw: Hardware, teacher_here: bool = True) -> int:
    """Host RAM a process needs beside the teacher's weights: its base, and without a GPU the student too."""
    if hw.gpu_bytes:
        return host_process_bytes(hw) + (teacher_activation_bytes(w) if teacher_here else 0)
    return host_process_bytes(hw) + training_bytes(w, "cpu", teacher_here)


def shm_size(host_memory_gib: float | None) -> int | None:
    """/dev/shm's size: this machine's (its free space), or on paper (`hardware.host_memory_gib`) Linux's default,
    half the RAM (a container's is often far smaller: docker run --shm-size)."""
    if host_memory_gib is not None:
        return int(host_memory_gib * GiB / 2)
    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:
        return None
