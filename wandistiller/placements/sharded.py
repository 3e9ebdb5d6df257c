"""`teacher_placement=sharded`: the frozen teacher sharded across all ranks with FSDP2 (`fully_shard`, one
unit per block); each rank runs its own batch, all-gathering each block's weights as it goes.

Loading is staggered rank by rank on a node, so host RAM holds one full copy at a time, and each block
moves to the device on its own, so a GPU never holds more than one full block plus its shards. Every
rank must run the same forwards (they are collectives): `Teacher.collective` makes sure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from wandistiller.core.distributed import local_device
from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option
from wandistiller.placements.base import Placement
from wandistiller.placements.memory import (
    Estimate,
    Hardware,
    Workload,
    beside_teacher_bytes,
    block_bytes,
    host_training_bytes,
)
from wandistiller.placements.memory import teacher_weight_bytes as weights
from wandistiller.teacher.model import Teacher, blocks_of, guidance_scales, load_expert


@dataclass
class ShardedConfig:
    _target_: str = "wandistiller.placements.sharded.ShardedPlacement"


class ShardedPlacement(Placement):
    name, speed_rank, collective, compilable = "sharded", 40, True, False

    def check(self, precision, world) -> None:
        if world.nproc_per_node * world.nnodes < 2:
            raise UserError(
                "teacher_placement=sharded splits the teacher over ranks: set distributed.nproc_per_node "
                "to 2 or more (or use teacher_placement=gpu, offload or cpu for one process)"
            )

    def estimate(self, w: Workload, hw: Hardware) -> Estimate:
        ranks = w.ranks_per_node
        if ranks < 2:
            return Estimate.refused(self.name, "needs 2 or more ranks")
        _, block = block_bytes(w.teacher_config, w.teacher_dtype_bytes)
        gpus = (weights(w) // ranks + 2 * block + beside_teacher_bytes(w),) * min(len(hw.gpu_bytes), ranks)
        # Loading is staggered (one full copy at a time); without a GPU the shards live in RAM.
        host = weights(w) + ranks * (host_training_bytes(w, hw) + (0 if hw.gpu_bytes else 2 * block))
        return Estimate.of(self.name, gpus, host, hw, f"FSDP2 shards over {ranks} ranks, gathering a block at a time")

    def teacher_device(self, topology) -> torch.device:
        return local_device(topology)

    def load(self, spec, teacher_cfg, precision, topology) -> Teacher:
        from torch.distributed.fsdp import fully_shard

        device = self.teacher_device(topology)
        mesh = init_device_mesh(device.type, (topology.world_size,))
        experts = []
        for name in spec.experts:
            for turn in range(topology.local_world_size):
                if turn == topology.local_rank:
                    expert = load_expert(spec, name, precision.teacher_dtype)  # on the CPU
                    for block in blocks_of(expert):
                        fully_shard(block, mesh=mesh)
                    fully_shard(expert, mesh=mesh)
                    experts.append(expert)
                dist.barrier()
        teacher = Teacher(spec, experts, guidance_scales(spec, teacher_cfg), device)
        teacher.collective = True
        return teacher


OPTION = Option("sharded", ShardedConfig, ShardedPlacement)
