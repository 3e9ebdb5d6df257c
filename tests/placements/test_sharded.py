"""Tests of wandistiller/placements/sharded.py, the teacher sharded over ranks with FSDP2: its refusal of one process,
its estimate (a shard and two gathered blocks per rank) on plain Workload/Hardware, and the fp8 teacher it cannot load.
Loading runs on two ranks in tests/core/test_distributed.py."""

from __future__ import annotations

import pytest

from tests.conftest import BF16
from tests.placements.test_memory import machine, tiny_workload
from wandistiller.core.distributed import World
from wandistiller.core.errors import UserError
from wandistiller.placements import memory
from wandistiller.placements.sharded import ShardedPlacement


def test_sharded_refuses_one_process_and_counts_the_ranks_of_every_node():
    with pytest.raises(UserError, match="set distributed.nproc_per_node to 2 or more"):
        ShardedPlacement().check(BF16, World(nproc_per_node=1, nnodes=1))
    ShardedPlacement().check(BF16, World(nproc_per_node=2, nnodes=1))
    ShardedPlacement().check(BF16, World(nproc_per_node=1, nnodes=2))  # one rank on each of two nodes


def test_each_gpu_holds_its_shard_two_gathered_blocks_and_the_training_beside_them():
    assert ShardedPlacement().estimate(tiny_workload(), machine(1)).note == "needs 2 or more ranks"
    w, hw = tiny_workload(ranks_per_node=4), machine(4)
    _, block = memory.block_bytes(w.teacher_config, 2)
    estimate = ShardedPlacement().estimate(w, hw)
    per_gpu = memory.teacher_weight_bytes(w) // 4 + 2 * block + memory.beside_teacher_bytes(w)
    assert estimate.gpu_bytes == (per_gpu,) * 4 and estimate.fits
    # Loading is staggered: host RAM holds one full copy, not one per rank.
    assert estimate.host_bytes == memory.teacher_weight_bytes(w) + 4 * memory.host_training_bytes(w, hw)


def test_without_a_gpu_the_shards_and_gathered_blocks_live_in_ram():
    w, hw = tiny_workload(ranks_per_node=2), machine(0)
    _, block = memory.block_bytes(w.teacher_config, 2)
    estimate = ShardedPlacement().estimate(w, hw)
    assert estimate.gpu_bytes == ()
    assert estimate.host_bytes == memory.teacher_weight_bytes(w) + 2 * (memory.host_training_bytes(w, hw) + 2 * block)
