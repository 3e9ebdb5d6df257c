"""Processes: who is who (Topology), the process group, and launching workers from inside the Hydra job.

`python -m wandistiller.train distributed.nproc_per_node=N` prepares once (teacher folder, text
embeddings, run folder) and then starts N workers with torch's elastic launcher, so a Hydra (multirun)
job is one fresh set of processes with one output folder. Plain `torchrun -m wandistiller.train` works
too: every rank runs the Hydra main, rank 0 prepares while the others wait.
"""

from __future__ import annotations

import datetime
import os
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world_size

    @property
    def node_ranks(self) -> range:
        start = self.node_rank * self.local_world_size
        return range(start, start + self.local_world_size)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls) -> Topology:
        env = os.environ
        return cls(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
        )


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", 1)) > 1


def init_process_group(topology: Topology, timeout_min: float) -> None:
    """gloo for CPU tensors, NCCL for CUDA ones; each rank pinned to its own GPU.

    The long timeout lets rank 0's slow one-off work (first teacher load, a checkpoint save) pass
    without tripping the other ranks' collectives; a rank that dies ends the job through the elastic
    agent, not through a timeout.
    """
    if not topology.distributed or dist.is_initialized():
        return
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(topology.local_rank % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_min))


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(entrypoint, args: tuple, distributed_cfg) -> list:
    """Start `nproc_per_node` workers on this node (and join `nnodes` nodes through c10d rendezvous)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    multi_node = distributed_cfg.nnodes > 1
    config = LaunchConfig(
        min_nodes=distributed_cfg.nnodes,
        max_nodes=distributed_cfg.nnodes,
        nproc_per_node=distributed_cfg.nproc_per_node,
        run_id=distributed_cfg.rdzv_id or (uuid.uuid4().hex[:12] if not multi_node else "wandistiller"),
        rdzv_backend="c10d",
        rdzv_endpoint=distributed_cfg.rdzv_endpoint or "localhost:0",
        max_restarts=0,
        monitor_interval=0.5,
        start_method="spawn",
    )
    os.environ["WANDISTILLER_LAUNCHED"] = "1"  # inherited by the workers: a stop is reported here (stopping.py)
    result = elastic_launch(config, entrypoint)(*args)
    return [result[i] for i in sorted(result)]
