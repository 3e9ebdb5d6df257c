"""`teacher_placement=device_map`: one teacher per node placed by accelerate over the node's GPUs, owned by
the node's first rank. `balanced` and `sequential` (their own modules) are this with accelerate's named
strategies; here the strategy is your own module -> GPU dict.

Only the owner loads it, so N ranks make one spread copy, not N (a plain device_map under torchrun loads N).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from wandistiller.core.distributed import gpu_count
from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option
from wandistiller.placements.base import Placement, Serving, load_teacher
from wandistiller.placements.memory import Estimate, Hardware, Workload, host_process_bytes, student_device_bytes
from wandistiller.placements.memory import teacher_activation_bytes as activations
from wandistiller.placements.memory import teacher_weight_bytes as weights


@dataclass
class DeviceMapConfig:
    _target_: str = "wandistiller.placements.device_map.DeviceMapPlacement"
    # accelerate's device_map: module name -> GPU index.
    strategy: Any = None
    # Per-GPU caps, e.g. {0: 20GiB, 1: 70GiB}.
    max_memory: Any = None
    # Keep the process layout, put the teacher on the CPU (tests, dry runs).
    debug_cpu: bool = False


class DeviceMapPlacement(Placement):
    min_gpus = 1
    name, speed_rank, serving = "device_map", 25, Serving.NODE_OWNER
    compilable = False  # accelerate's cross-device hooks and dynamo: not tried
    auto_candidate = False

    def __init__(
        self,
        strategy: Any = DeviceMapConfig.strategy,
        max_memory: Any = DeviceMapConfig.max_memory,
        debug_cpu: bool = DeviceMapConfig.debug_cpu,
    ):
        self.strategy, self.max_memory, self.debug_cpu = strategy, max_memory, debug_cpu

    def check(self, precision, world) -> None:
        self.check_settings()
        if not self.debug_cpu and gpu_count() == 0:
            raise UserError(
                f"teacher_placement={self.name} spreads the teacher over GPUs and none is visible; "
                "use teacher_placement=cpu"
            )
        if not self.debug_cpu:
            gpus = [*(self.strategy.values() if isinstance(self.strategy, Mapping) else []), *(self.max_memory or {})]
            missing = sorted({int(g) for g in gpus if str(g).isdigit() and int(g) >= gpu_count()})
            if missing:
                raise UserError(
                    f"teacher_placement names GPU {', '.join(map(str, missing))}, and this node has {gpu_count()} "
                    f"(0-{gpu_count() - 1}); name those in teacher_placement.strategy and max_memory"
                )

    def check_settings(self) -> None:
        """The strategy and caps as accelerate takes them."""
        if self.strategy is None:
            raise UserError(
                f"teacher_placement=device_map needs teacher_placement.strategy, a map of module to GPU, e.g. "
                f"'teacher_placement.strategy={EXAMPLE}' (quoted for the shell), or accelerate's own "
                "(teacher_placement.strategy=auto); or use teacher_placement=balanced / sequential, or gpu0 for the "
                "whole teacher on GPU 0"
            )
        check_map(self.strategy, self.max_memory)

    def shares(self, w: Workload, hw: Hardware) -> list[int]:
        """Teacher bytes per GPU: a hand-written map is planned as an even spread."""
        return [weights(w) // len(hw.gpu_bytes)] * len(hw.gpu_bytes)

    def estimate(self, w: Workload, hw: Hardware) -> Estimate:
        if not hw.gpu_bytes:
            return Estimate.refused(self.name, "needs a GPU")
        used = self.student_gpus(w, hw)
        student, act = student_device_bytes(w), activations(w)
        gpus = tuple(
            s + (act if i == 0 else 0) + (student if i < used else 0) for i, s in enumerate(self.shares(w, hw))
        )
        return Estimate.of(self.name, gpus, host_process_bytes(hw) * max(used, 1), hw, self.note(hw))

    def student_gpus(self, w: Workload, hw: Hardware) -> int:
        """How many of the node's GPUs also hold a training rank's student."""
        return min(len(hw.gpu_bytes), max(w.ranks_per_node, 1))

    def note(self, hw: Hardware) -> str:
        return "your device map (planned as an even spread)"

    def teacher_device(self, topology) -> torch.device:
        return torch.device("cpu") if self.debug_cpu else torch.device("cuda", topology.local_rank % gpu_count())

    def load(self, spec, teacher_cfg, precision, topology):
        device = self.teacher_device(topology)
        if self.debug_cpu:
            return load_teacher(spec, teacher_cfg, precision.teacher_dtype, device)
        strategy = self.strategy if isinstance(self.strategy, str) else dict(self.strategy)
        max_memory = {int(k) if str(k).isdigit() else k: v for k, v in (self.max_memory or {}).items()} or None
        teacher = load_teacher(
            spec, teacher_cfg, precision.teacher_dtype, device, device_map=strategy, max_memory=max_memory
        )
        # Inputs go where the first layer lives; accelerate's hooks carry activations across GPUs.
        first = teacher.experts[0].get_submodule("patch_embedding")
        teacher.device = next(first.parameters()).device
        return teacher


# A hand-written map, as the refusal of none shows it (the yaml's comment gives a whole one).
EXAMPLE = (
    "{patch_embedding: 0, condition_embedder: 0, blocks: 1, norm_out: 1, proj_out: 1, scale_shift_table: 1, rope: 0}"
)
# accelerate's named strategies, which `device_map=` takes as a string.
NAMED = ("auto", "balanced", "balanced_low_0", "sequential")


def check_map(strategy: Any, max_memory: Any) -> None:
    """The strategy and the caps in the shapes accelerate takes, before any GPU is asked: a string it does not name, a
    GPU that is no index or a cap that is no size was its traceback at load, after the wait for the teacher."""
    if isinstance(strategy, str):
        if strategy not in NAMED:
            raise UserError(
                f"teacher_placement.strategy={strategy} is no strategy accelerate names ({', '.join(NAMED)}); or give "
                f"a map of module to GPU, e.g. 'teacher_placement.strategy={EXAMPLE}'"
            )
    elif not isinstance(strategy, Mapping) or not strategy:
        raise UserError(f"teacher_placement.strategy={strategy} is no map of module to GPU; e.g. {EXAMPLE}")
    else:
        for module, gpu in strategy.items():  # as accelerate takes them: a GPU index, cuda:N, cpu or disk
            index = isinstance(gpu, int) and not isinstance(gpu, bool) and gpu >= 0
            if not index and gpu not in ("cpu", "disk") and not re.fullmatch(r"cuda:\d+", str(gpu)):
                raise UserError(
                    f"teacher_placement.strategy puts {module or 'the model'} on {gpu!r}; give a GPU index (0, 1, …), "
                    "cuda:N, cpu or disk"
                )
    if max_memory is None:
        return
    from accelerate.utils import convert_file_size_to_int  # accelerate's reading of a cap: what load will do

    if not isinstance(max_memory, Mapping):
        raise UserError(f"teacher_placement.max_memory={max_memory} is no map of GPU to cap; e.g. '{{0: 20GiB}}'")
    for gpu, cap in max_memory.items():
        if not (str(gpu).isdigit() or gpu == "cpu"):
            raise UserError(f"teacher_placement.max_memory caps {gpu!r}; give a GPU index (0, 1, …) or cpu")
        number = isinstance(cap, (int, float)) and not isinstance(cap, bool)
        if number and 0 <= cap < math.inf:  # bytes, which accelerate takes as they are (2e10 too)
            continue
        try:
            convert_file_size_to_int(cap)  # a string: accelerate's own reading of it
        except (ValueError, TypeError, AttributeError):
            raise UserError(
                f"teacher_placement.max_memory caps GPU {gpu} at {cap!r}; give a size, e.g. 20GiB or 20000000000 "
                "(bytes)"
            ) from None


def sequential_shares(w: Workload, hw: Hardware) -> list[int]:
    """Fill GPU 0 first (beside the student and the activations), then the next."""
    share, left = [], weights(w)
    for cap in hw.gpu_bytes:
        take = max(min(left, hw.usable(cap) - student_device_bytes(w) - activations(w)), 0)
        share.append(take)
        left -= take
    share[-1] += left
    return share


OPTION = Option("device_map", DeviceMapConfig, DeviceMapPlacement)
