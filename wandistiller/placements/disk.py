"""`teacher_placement=disk`: teacher weights stay in their safetensors files (memory-mapped) and stream block
by block as `offload` does, for teachers larger than RAM. Computes on this rank's GPU, or on the CPU where
there is none. A teacher stored wider than it computes (Wan's Hub checkpoints are fp32) is converted once,
block by block, into `offload_dir` and streamed from the copy: half the bytes per forward for bf16.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option
from wandistiller.placements.disk_source import converted_copy
from wandistiller.placements.memory import (
    Estimate,
    Hardware,
    Workload,
    block_bytes,
    host_process_bytes,
    host_training_bytes,
)
from wandistiller.placements.offload import OffloadPlacement
from wandistiller.teacher.fp8 import fp8_layers_of


@dataclass
class DiskConfig:
    _target_: str = "wandistiller.placements.disk.DiskPlacement"
    resident_blocks: Any = "auto"
    # Where a teacher stored wider than it computes is converted once (null: convert each block as it streams).
    offload_dir: str | None = None


class DiskPlacement(OffloadPlacement):
    min_gpus = 0
    name, speed_rank, fp8 = "disk", 60, True
    backprop = True  # as offload's: each block read again in backward and recomputed
    source = "disk"
    streamed_from = 2e9  # extrapolated: an NVMe read, bytes per second (the page cache aside)

    def __init__(
        self, resident_blocks: Any = DiskConfig.resident_blocks, offload_dir: str | None = DiskConfig.offload_dir
    ):
        super().__init__(resident_blocks, share_host_copy=False)
        self.offload_dir = offload_dir

    def check(self, precision, world) -> None:
        self.check_settings()  # no GPU needed: without one it computes on the CPU

    def speed(self, hw: Hardware) -> int:
        # Without a GPU, streaming from disk to the CPU is the slowest way, not the second slowest.
        return self.speed_rank if hw.gpu_bytes else 80

    def on_training_device(self, hw: Hardware) -> bool:
        return True  # a GPU's where there is one, else the CPU's: where the student trains

    def estimate(self, w: Workload, hw: Hardware) -> Estimate:
        w = dataclasses.replace(w, teacher_checkpointed=True)  # a backward through it recomputes each block
        outside, block = block_bytes(w.teacher_config, w.teacher_dtype_bytes, w.teacher_fp8)
        if not hw.gpu_bytes:
            host = (w.experts * (outside + 2 * block) + host_training_bytes(w, hw)) * w.ranks_per_node
            return Estimate.of(self.name, (), host, hw, "safetensors on disk -> RAM, one block ahead, on the CPU")
        kept, gpus, block = self.streaming_gpu_bytes(w, hw)
        host = (2 * block + host_process_bytes(hw)) * w.ranks_per_node
        note = f"safetensors on disk -> GPU, one block ahead; {kept}/{w.teacher_config['num_layers']} blocks resident"
        return Estimate.of(self.name, gpus, host, hw, note, resident_blocks=kept)

    def expert_folder(self, folder: Path, precision, topology, quantize: str | None = None) -> Path:

        if not all(os.access(f, os.R_OK) for f in folder.glob("*.safetensors")):
            raise UserError(
                f"teacher_placement=disk reads {folder} while training and cannot: make its "
                "*.safetensors readable, or use teacher_placement=offload"
            )
        # fp8: the converted copy holds the quantized layers (half the bytes read per forward)
        layers = fp8_layers_of(folder) if quantize else frozenset()
        return converted_copy(folder, precision.teacher_dtype, self.offload_dir, topology, layers)


OPTION = Option("disk", DiskConfig, DiskPlacement)
