"""`teacher_placement=offload`: teacher weights in pinned host RAM, streamed to this rank's GPU block by
block, the next block prefetched on a side stream while the current one computes.

The first `resident_blocks` blocks stay on the GPU (a run gets the planner's count of what fits beside
the student; "auto" without a plan: what the free memory holds). With `share_host_copy` the ranks of a
node share one pinned copy (through /dev/shm). `disk` (its own module) streams the same way from the
safetensors files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from wandistiller.core.distributed import gpu_count, local_device
from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option
from wandistiller.placements.base import Placement
from wandistiller.placements.memory import (
    Estimate,
    Hardware,
    Workload,
    beside_teacher_bytes,
    block_bytes,
    blocks_that_fit,
    host_process_bytes,
)
from wandistiller.placements.memory import resident_blocks as blocks_free_memory_holds
from wandistiller.placements.streaming import load_streamed_expert
from wandistiller.teacher.finetune import patch_of
from wandistiller.teacher.model import Teacher, guidance_scales


@dataclass
class OffloadConfig:
    _target_: str = "wandistiller.placements.offload.OffloadPlacement"
    # Blocks kept on the GPU: auto = as many as the planner finds room for, or a count >= 0.
    resident_blocks: Any = "auto"
    # One pinned copy per node, shared by its ranks through /dev/shm; false = one per rank.
    share_host_copy: bool = True


class OffloadPlacement(Placement):
    min_gpus = 1
    name, speed_rank, fp8 = "offload", 50, True
    backprop = True  # each block streamed in again in backward and recomputed (streaming.Recomputed); disk's too
    source = "host"  # where the streamed blocks are read from (streaming.load_streamed_expert)
    # measured: a 14B expert's bf16 host-to-GPU copy floor (~0.5 s per forward on an H200: docs/REAL_MODEL.md)
    streamed_from = 55e9

    def __init__(
        self,
        resident_blocks: Any = OffloadConfig.resident_blocks,
        share_host_copy: bool = OffloadConfig.share_host_copy,
    ):
        self.resident_blocks, self.share_host_copy = resident_blocks, share_host_copy

    def check(self, precision, world) -> None:
        if gpu_count() == 0:
            raise UserError(
                "teacher_placement=offload streams the teacher from RAM to a GPU and none is visible; "
                "use teacher_placement=cpu (the same RAM, computing on the CPU)"
            )
        self.check_settings()

    def check_settings(self) -> None:
        if self.resident_blocks != "auto" and not str(self.resident_blocks).isdigit():
            raise UserError(f"teacher_placement.resident_blocks={self.resident_blocks!r}: use auto or a count >= 0")

    def estimate(self, w: Workload, hw: Hardware) -> Estimate:
        if not hw.gpu_bytes:
            return Estimate.refused(self.name, "needs a GPU")
        w = dataclasses.replace(w, teacher_checkpointed=True)  # a backward through it recomputes each block
        kept, gpus, block = self.streaming_gpu_bytes(w, hw)
        # Only the streamed blocks are pinned; the resident ones and what is outside the blocks go to the GPU
        # (streaming.stream_blocks). A 14B expert with 25 of 40 blocks resident held 11.2 GiB, not 26.6 (an H200).
        pinned = w.experts * (w.teacher_config["num_layers"] - kept) * block
        copies = 1 if self.share_host_copy else w.ranks_per_node
        shared = self.share_host_copy and w.ranks_per_node > 1  # the node's ranks map one copy in /dev/shm
        if shared and hw.shm_bytes is not None and pinned > hw.shm_bytes:
            return Estimate.refused(
                self.name,
                f"needs its shared pinned copy ({pinned / 2**30:.1f} GiB) in /dev/shm, which holds "
                f"{hw.shm_bytes / 2**30:.1f} GiB: enlarge it (docker run --shm-size) or set "
                "teacher_placement.share_host_copy=false",
            )
        host = pinned * copies + (block + host_process_bytes(hw)) * w.ranks_per_node
        note = "pinned RAM -> GPU, one block ahead, " + ("a copy per node" if copies == 1 else "a copy per rank")
        note += f"; {kept}/{w.teacher_config['num_layers']} blocks resident"
        return Estimate.of(self.name, gpus, host, hw, note, resident_blocks=kept)

    def streaming_gpu_bytes(self, w: Workload, hw: Hardware) -> tuple[int, tuple[int, ...], int]:
        """(blocks kept resident, bytes per GPU, bytes of one block): what is left over after the student and
        the activations keeps the first blocks resident, so fewer bytes stream per forward."""
        outside, block = block_bytes(w.teacher_config, w.teacher_dtype_bytes, w.teacher_fp8)
        beside = beside_teacher_bytes(w)  # the student, the teacher's transient forward, the context
        budget = hw.usable(min(hw.gpu_bytes)) - beside
        kept = blocks_that_fit(w.teacher_config, w.experts, w.teacher_dtype_bytes, budget, w.teacher_fp8)
        if self.resident_blocks != "auto":
            kept = min(int(self.resident_blocks), w.teacher_config["num_layers"])
        streaming = w.experts * (outside + (2 + kept) * block) + beside  # two slots per expert
        return kept, (streaming,) * min(len(hw.gpu_bytes), w.ranks_per_node), block

    def with_plan(self, estimate: Estimate | None) -> None:
        """The planner decides what `auto` leaves open: how many blocks stay resident."""
        if estimate is not None and estimate.resident_blocks is not None and self.resident_blocks == "auto":
            self.resident_blocks = estimate.resident_blocks

    def teacher_device(self, topology) -> torch.device:
        return local_device(topology)

    def expert_folder(self, folder: Path, precision, topology, quantize: str | None = None) -> Path:
        """Where an expert's streamed weights are read from."""
        return folder

    def load(self, spec, teacher_cfg, precision, topology) -> Teacher:

        device = self.teacher_device(topology)
        experts, streamers = [], []
        quantize = getattr(teacher_cfg, "quantize", None)
        for name in spec.experts:
            # A fine-tuned teacher (teacher.lora): its LoRAs merged into each tensor as it is read, before quantizing
            # (so never from a copy already quantized: disk's fp8 offload_dir copy is made in the teacher's dtype).
            patch = patch_of(spec.loras, name)
            folder = self.expert_folder(spec.path / name, precision, topology, None if patch else quantize)
            expert, streamer = load_streamed_expert(
                folder,
                precision.teacher_dtype,
                device,
                self.source,
                self._resident(spec, precision, device, bool(quantize)),
                share=self._share(folder, topology),
                quantize=quantize,
                patch=patch,
            )
            experts.append(expert)
            streamers += [streamer] if streamer is not None else []
        teacher = Teacher(spec, experts, guidance_scales(spec, teacher_cfg), device)
        teacher.streamers = streamers
        return teacher

    def _share(self, folder: Path, topology) -> tuple[str, object] | None:
        """(a name the node's ranks agree on, topology) when they should share one host copy, else None."""
        if not self.share_host_copy or topology.local_world_size < 2:
            return None
        job = ":".join(os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"))
        return f"wandistiller-{hashlib.sha1(f'{job}:{folder}'.encode()).hexdigest()[:16]}", topology

    def _resident(self, spec, precision, device: torch.device, fp8: bool = False) -> int:
        if self.resident_blocks != "auto":
            return int(self.resident_blocks)
        if device.type != "cuda":
            return 0
        free, _ = torch.cuda.mem_get_info(device)
        config, experts = spec.transformer_config, len(spec.experts)
        return blocks_free_memory_holds(config, experts, precision.teacher_dtype, free, fp8)


OPTION = Option("offload", OffloadConfig, OffloadPlacement)
