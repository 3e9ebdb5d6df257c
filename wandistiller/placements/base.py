"""The interface every teacher placement implements, and what they share.

A placement answers two questions: where do the teacher's weights live, and who runs the teacher for
whom. Each option of `conf/teacher_placement/` is one module of this package holding one class and
its config schema (so a key the option does not take fails when the config is composed):

    name             the option's name (what the planner, reports and errors call it)
    serving          Serving.LOCAL (every rank runs its own teacher), NODE_OWNER (one rank per node runs
                     it and also trains) or DEDICATED_OWNER (one rank per node only runs the teacher)
    compilable       whether teacher.compile=true (regional torch.compile) works with it
    collective       whether the teacher's forwards are collectives (every rank must run each one)
    fp8              whether teacher.quantize=fp8 (wandistiller.teacher.fp8) works with it
    hidden_states    whether its teacher returns hidden states after chosen blocks with the velocity (hidden KD)
    whole_on_one_device   whether the whole teacher sits on one device (the end-of-run evaluation runs there)
    backprop         whether a gradient can pass through its frozen teacher in the training process (a LoRA fake
                     score: method.fake_score=lora; a streamed teacher recomputes each block in backward)
    streamed_from    bytes per second its teacher's blocks stream in at (None: they stay put): the planner's time
    teacher_on_cpu   whether its teacher computes on the CPU even where there is a GPU (the planner's time)
    check(precision, world)            refuse early, before any weights load, naming a fix
                     (check_quantize_placement: a placement that cannot load an fp8 teacher, from `fp8`)
    estimate(workload, hardware)       bytes on each device (the planner's input)
    teacher_device(topology)           where inputs go (and targets come from)
    load(spec, teacher_cfg, precision, topology) -> Teacher
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Any, ClassVar

import torch

from wandistiller.core.distributed import Topology, World
from wandistiller.core.errors import UserError
from wandistiller.core.precision import Precision
from wandistiller.placements.memory import Estimate, Hardware, Workload
from wandistiller.placements.streaming import load_fp8_expert
from wandistiller.teacher.finetune import patch_of
from wandistiller.teacher.model import Teacher, compile_unavailable, guidance_scales, load_expert
from wandistiller.teacher.spec import TeacherSpec


class Serving(str, Enum):
    LOCAL = "local"
    NODE_OWNER = "node_owner"
    DEDICATED_OWNER = "dedicated_owner"


class Placement(ABC):
    name: ClassVar[str]
    # The planner's whole notion of speed: `auto` takes the fitting placement with the lowest rank.
    speed_rank: ClassVar[int]
    serving: Serving = Serving.LOCAL
    compilable: ClassVar[bool] = True
    collective: ClassVar[bool] = False
    # Loads an fp8 teacher (teacher.quantize=fp8). Not yet: accelerate's device maps and FSDP2's shards.
    fp8: ClassVar[bool] = False
    # Its teacher returns the hidden states after the blocks a loss asks for, in the forward that gives the
    # velocity (`Teacher.targets(..., layers)`; served ones send them): every shipped placement.
    hidden_states: ClassVar[bool] = True
    # Whether `auto` may choose it (a hand-written device map is the user's own choice).
    auto_candidate: ClassVar[bool] = True
    # The whole teacher on one device, as `python -m wandistiller.eval` loads it (the end-of-run evaluation runs).
    whole_on_one_device: ClassVar[bool] = False
    # Autograd can run through its frozen teacher in the process that holds it (LoRA adapters on it train: dmd's
    # method.fake_score=lora): a resident nn.Module (cpu, gpu), or blocks streamed in again for the backward and
    # recomputed (offload, disk: streaming.Recomputed). Not where a device map spreads it (balanced, sequential,
    # device_map), collectives shard it (sharded), or another process holds it (gpu0's dedicated owner). An fp8
    # teacher (teacher.quantize=fp8) backpropagates too, wherever it loads (`fp8`).
    backprop: ClassVar[bool] = False
    # Bytes per second a streamed teacher's blocks arrive at (offload, disk), for the planner's step time, which
    # overlaps each block's copy with its compute; None: its blocks do not stream.
    streamed_from: ClassVar[float | None] = None
    # Its teacher computes on the CPU even where there is a GPU (cpu): the planner times its calls at the CPU's rate.
    teacher_on_cpu: ClassVar[bool] = False
    # GPUs its `check` asks for with its default keys (`debug_cpu=true` keeps gpu0's/balanced's layout on 0).
    min_gpus: ClassVar[int] = 0

    # A GPU placement's layout kept on the CPU (gpu0, balanced, sequential, device_map: `debug_cpu=true`).
    debug_cpu: bool = False

    @staticmethod
    def default_ranks() -> int:
        """distributed.nproc_per_node when the user left it at 1 (gpu0: one process per GPU)."""
        return 1

    def with_plan(self, estimate: Estimate) -> None:  # noqa: B027 -- most placements need nothing from the plan
        """The planner's estimate for this placement, before it loads (offload sizes its resident blocks)."""

    def check(self, precision: Precision, world: World) -> None:  # noqa: B027 -- most placements check nothing
        """Refuse a placement that cannot run here (no GPU, too few ranks), naming one that can."""

    def check_settings(self) -> None:  # noqa: B027 -- most placements have no settings to check
        """Refuse settings no machine could run (a bad resident_blocks, a map accelerate cannot read): called by
        `check` and by the planner, which plans for hardware other than this machine's."""

    def speed(self, hw: Hardware) -> int:
        return self.speed_rank

    def on_training_device(self, hw: Hardware) -> bool:
        """Whether its teacher computes on the device the student trains on (a GPU where there is one)."""
        return (self.min_gpus > 0) == bool(hw.gpu_bytes)

    @abstractmethod
    def estimate(self, w: Workload, hw: Hardware) -> Estimate: ...

    @abstractmethod
    def teacher_device(self, topology: Topology) -> torch.device: ...

    @abstractmethod
    def load(self, spec: TeacherSpec, teacher_cfg: Any, precision: Precision, topology: Topology) -> Teacher: ...


def check_quantize_placement(mode: str | None, placement: Placement) -> None:
    """Refuse a placement that cannot load an fp8 teacher, naming those that can (from their `fp8` flag)."""
    from wandistiller.placements import names_where  # noqa: PLC0415 -- cycle: the registry's package imports this

    if mode is None or placement.fp8:
        return
    able = names_where(lambda cls: cls.fp8)
    raise UserError(
        f"teacher.quantize={mode} cannot run with teacher_placement={placement.name}; use one of "
        f"{', '.join(able)}, or drop teacher.quantize"
    )


def load_teacher(
    spec: TeacherSpec, teacher_cfg: Any, dtype: torch.dtype, device: torch.device, **load_kwargs: Any
) -> Teacher:
    """Every expert through `load_expert` (from_pretrained + freeze), then onto `device` unless a map placed it.
    With teacher.quantize=fp8: read block by block and quantized as read (the bf16 teacher never in RAM)."""
    if getattr(teacher_cfg, "quantize", None):  # a fine-tuned teacher's LoRAs merged as read, before quantizing
        patches = [patch_of(spec.loras, name) for name in spec.experts]
        experts = [load_fp8_expert(spec.path / name, dtype, device, p) for name, p in zip(spec.experts, patches)]
        return Teacher(spec, experts, guidance_scales(spec, teacher_cfg), device)
    experts = [load_expert(spec, name, dtype, **load_kwargs) for name in spec.experts]
    if "device_map" not in load_kwargs:
        experts = [e.to(device) for e in experts]
    return Teacher(spec, experts, guidance_scales(spec, teacher_cfg), device)


def check_adapters_on_teacher(
    key: str, placement: Placement, ranks: int, device: torch.device, teacher_cfg: Any, instead: str
) -> None:
    """Adapters trained on the placed teacher (`key`: student=lora, method.fake_score=lora) backpropagate through
    its frozen weights on every training rank: refuse, in one line ending with `instead` (the other choice), a
    placement that cannot (`backprop`, the teacher on the training device), one that serves ranks holding no
    teacher, and a compiled one where torch.compile cannot compile for `device` (a compiled one takes adapters:
    teacher/lora.py). An fp8 teacher takes adapters (teacher/fp8.py: the backward passes through its frozen layers
    to their inputs)."""
    from wandistiller.placements import names_where  # noqa: PLC0415 -- cycle: the registry's package imports this

    here = placement.teacher_device(Topology()).type == device.type
    if not (placement.backprop and here):
        able = names_where(lambda cls: cls.backprop)
        raise UserError(
            f"{key} backpropagates through the frozen teacher on the training device ({device.type}), and "
            f"teacher_placement={placement.name} cannot; use {instead}, or teacher_placement={' or '.join(able)}"
        )
    if placement.serving != Serving.LOCAL and ranks > 1:  # (one rank per node would do: refused all the same)
        local = names_where(lambda cls: cls.backprop and cls.serving == Serving.LOCAL)
        raise UserError(
            f"{key} runs the teacher on every training rank, and teacher_placement={placement.name} with {ranks} "
            f"processes serves ranks that hold none; use distributed.nproc_per_node=1, teacher_placement="
            f"{' or '.join(local)} (a teacher on every rank), or {instead}"
        )
    why = compile_unavailable(device) if getattr(teacher_cfg, "compile", False) else None
    if why:  # compiled, the adapted blocks run where the adapters train: this device
        raise UserError(
            f"teacher.compile=true with {key} compiles the adapted teacher's blocks on {device.type}, and {why}; "
            f"drop teacher.compile"
        )
