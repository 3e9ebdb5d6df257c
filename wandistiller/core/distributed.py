"""Processes: who is who (Topology), the process group, and launching workers from inside the Hydra job.

`python -m wandistiller.train distributed.nproc_per_node=N` prepares once (teacher folder, text
embeddings, run folder) and then starts N workers with torch's elastic launcher, so a Hydra (multirun)
job is one fresh set of processes with one output folder. Plain `torchrun -m wandistiller.train` works
too: every rank runs the Hydra main, rank 0 prepares while the others wait.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


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


@dataclass(frozen=True)
class World:
    """How many processes a run has: configured, or started by torchrun (whose count wins)."""

    nproc_per_node: int
    nnodes: int

    @classmethod
    def of(cls, distributed_cfg, topo: Topology) -> World:
        nodes = topo.world_size // topo.local_world_size
        return cls(max(distributed_cfg.nproc_per_node, topo.local_world_size), max(distributed_cfg.nnodes, nodes))

    @property
    def size(self) -> int:
        return self.nproc_per_node * self.nnodes


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_device(topology: Topology) -> torch.device:
    """This rank's own GPU (a node's ranks share its GPUs round-robin), or the CPU on a machine without one."""
    return torch.device("cuda", topology.local_rank % gpu_count()) if gpu_count() else torch.device("cpu")


@dataclass(frozen=True)
class Served:
    """A rank an owner serves: its global rank (for sends) and data-parallel rank (for its batch)."""

    rank: int
    dp_rank: int


@dataclass(frozen=True)
class Roles:
    """Who does what, from the placement's serving mode and the process layout."""

    trains: bool
    has_teacher: bool
    owner: int | None  # the rank serving this rank's targets; None when it computes its own
    served: tuple[Served, ...]  # ranks this rank serves (owners only)
    students: tuple[int, ...]  # every training rank (the DDP group)
    dp_rank: int  # index among the students; -1 for a dedicated owner

    @property
    def main(self) -> int:
        """The first training rank writes checkpoints, outputs and the tracker."""
        return self.students[0]


def roles_for(serving: str, topo: Topology) -> Roles:
    """`serving` is a placement's Serving: local, node_owner or dedicated_owner."""
    everyone = tuple(range(topo.world_size))
    owner = topo.node_ranks[0]
    if serving == "local":
        return Roles(True, True, None, (), everyone, topo.rank)
    students = everyone if serving == "node_owner" else tuple(r for r in everyone if r % topo.local_world_size)
    if not students:
        raise RuntimeError("no training rank: a dedicated teacher owner needs more than one process per node")
    served = tuple(Served(r, students.index(r)) for r in topo.node_ranks if r != owner)
    is_owner = topo.rank == owner
    return Roles(
        trains=topo.rank in students,
        has_teacher=is_owner,
        owner=None if is_owner else owner,
        served=served if is_owner else (),
        students=students,
        dp_rank=students.index(topo.rank) if topo.rank in students else -1,
    )


def barrier(topo: Topology) -> None:
    if topo.distributed:
        dist.barrier()


def made_once(topo: Topology, make, read, makes: bool | None = None):
    """The one home of "one rank makes it, the others read what it wrote" (text embeddings, teacher latents,
    encoded images: caches on disk): `make()` where `makes` (default: rank 0), a barrier, then `read()` on
    every other rank. Every rank calls it, so every rank meets the barrier."""
    makes = topo.rank == 0 if makes is None else makes
    made = make() if makes else None
    barrier(topo)
    return made if makes else read()


def gather(topo: Topology, item: dict) -> list[dict]:
    """`item` from every rank, in rank order (just `[item]` in one process)."""
    if not topo.distributed:
        return [item]
    items: list = [None] * topo.world_size
    dist.all_gather_object(items, item)
    return items


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
    timeout = datetime.timedelta(minutes=timeout_min)
    if LOOPBACK_STORE in os.environ:  # workers `launch` started on one node: its loopback-only store
        host, port = os.environ[LOOPBACK_STORE].rsplit(":", 1)
        tcp = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"wandistiller/{os.environ.get('TORCHELASTIC_RUN_ID', '')}", tcp)
        dist.init_process_group(
            backend, store=store, rank=topology.rank, world_size=topology.world_size, timeout=timeout
        )
        return
    dist.init_process_group(backend=backend, timeout=timeout)


def destroy_process_group() -> None:
    """Leave the group once nothing else holds it. A DDP reducer that outlives its gloo group joins gloo's
    worker thread while holding the GIL, and that thread may need the GIL to free its last finished work:
    a deadlock at exit (torch 2.13). So collect the reducers first and let the worker threads run dry."""
    if dist.is_initialized():
        gc.collect()
        time.sleep(0.1)
        dist.destroy_process_group()


def launch(entrypoint, args: tuple, distributed_cfg) -> list:
    """Start `nproc_per_node` workers on this node (and join `nnodes` nodes through c10d rendezvous).

    One node with no rendezvous endpoint given: nothing listens beyond this machine. torch's own stores
    bind every interface whatever host they are given, so the rendezvous and the workers' process group
    share one store this process serves on a socket bound to 127.0.0.1, and gloo/NCCL use the loopback.
    """

    multi_node = distributed_cfg.nnodes > 1
    local = not multi_node and not distributed_cfg.rdzv_endpoint
    with loopback_only() if local else contextlib.nullcontext() as endpoint:
        config = LaunchConfig(
            min_nodes=distributed_cfg.nnodes,
            max_nodes=distributed_cfg.nnodes,
            nproc_per_node=distributed_cfg.nproc_per_node,
            run_id=distributed_cfg.rdzv_id or (uuid.uuid4().hex[:12] if not multi_node else "wandistiller"),
            rdzv_backend="c10d",
            rdzv_endpoint=endpoint or distributed_cfg.rdzv_endpoint,
            rdzv_configs={"is_host": False} if local else {},  # a client of the loopback store
            local_addr="127.0.0.1" if local else None,
            max_restarts=0,
            monitor_interval=0.5,
            start_method="spawn",
        )
        with launched_env():  # inherited by the workers: a stop is reported here (stopping.py)
            result = elastic_launch(config, entrypoint)(*args)
    return [result[i] for i in sorted(result)]


@contextlib.contextmanager
def launched_env():
    """WANDISTILLER_LAUNCHED=1 for the workers a launch spawns, and this process's own value back after it: a
    later run in this process (a sweep's next point, a test) reports its own stop again."""
    before = os.environ.get("WANDISTILLER_LAUNCHED")
    os.environ["WANDISTILLER_LAUNCHED"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("WANDISTILLER_LAUNCHED", None)
        else:
            os.environ["WANDISTILLER_LAUNCHED"] = before


LOOPBACK_STORE = "WANDISTILLER_LOOPBACK_STORE"


@contextlib.contextmanager
def loopback_only():
    """A TCPStore served on 127.0.0.1 only (a socket bound here, handed to it), and the environment that
    makes the launch use it: its endpoint, for the rendezvous and (LOOPBACK_STORE) the workers' group."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.detach()
    )  # the store owns (and closes) it
    env = {
        LOOPBACK_STORE: f"127.0.0.1:{port}",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # else the agent serves another store, on every interface
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo"),
    }
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        del store


def worker_logging(topo: Topology, run_dir: Path) -> None:
    """Spawned workers have no Hydra logging: rank 0 logs to the console and train.log, others to their own file."""
    fmt = logging.Formatter(f"[%(asctime)s][rank {topo.rank}][%(levelname)s] - %(message)s")
    handlers: list[logging.Handler] = [
        logging.FileHandler(run_dir / ("train.log" if topo.rank == 0 else f"train_rank{topo.rank}.log"))
    ]
    if topo.rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
