"""Tests of wandistiller/placements/device_map.py, one teacher per node spread over its GPUs by accelerate: its
refusals (no GPU, no strategy), the even spread it plans and `sequential_shares` (GPU 0 first), on plain dataclasses."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import BF16
from tests.placements.test_memory import machine, tiny_workload
from wandistiller.core.distributed import Topology, World, gpu_count
from wandistiller.core.errors import UserError
from wandistiller.placements import memory, planner_candidates
from wandistiller.placements.device_map import DeviceMapPlacement, sequential_shares

ONE = World(nproc_per_node=1, nnodes=1)


@pytest.mark.skipif(gpu_count() > 0, reason="checks the refusal on a machine without a GPU")
def test_a_device_map_without_a_gpu_is_refused_naming_cpu():
    with pytest.raises(UserError, match="teacher_placement=device_map spreads the teacher over GPUs .* use .*=cpu"):
        DeviceMapPlacement(strategy={"": 0}).check(BF16, ONE)


def test_a_device_map_without_a_strategy_is_refused_naming_the_key_and_the_named_strategies():
    with pytest.raises(
        UserError, match=r"needs teacher_placement.strategy=\{module: GPU, …\}; .*balanced / sequential"
    ):
        DeviceMapPlacement(debug_cpu=True).check(BF16, ONE)
    DeviceMapPlacement(strategy={"": 0}, debug_cpu=True).check(BF16, ONE)
    assert DeviceMapPlacement(debug_cpu=True).teacher_device(Topology(local_rank=1)) == torch.device("cpu")


def test_a_hand_written_map_is_planned_as_an_even_spread_with_the_activations_on_gpu_0():
    assert DeviceMapPlacement().estimate(tiny_workload(), machine(0)).note == "needs a GPU"
    w, hw = tiny_workload(ranks_per_node=2), machine(4)
    share = memory.teacher_weight_bytes(w) // 4
    student, act = memory.student_device_bytes(w), memory.teacher_activation_bytes(w)
    estimate = DeviceMapPlacement(strategy={"": 0}).estimate(w, hw)
    assert estimate.gpu_bytes == (share + act + student, share + student, share, share)  # 2 ranks train
    assert estimate.host_bytes == 2 * memory.host_process_bytes(hw)
    assert "device_map" not in {p.name for p in planner_candidates()}  # the user's own map: auto never picks it


def test_sequential_shares_fill_gpu_0_first_and_leave_what_fits_nowhere_on_the_last():
    w = tiny_workload()
    weights, beside = (
        memory.teacher_weight_bytes(w),
        memory.student_device_bytes(w) + memory.teacher_activation_bytes(w),
    )
    assert sequential_shares(w, machine(3)) == [weights, 0, 0]
    half = machine(3, gpu_bytes=beside + weights // 2, headroom_fraction=0.0)
    assert sequential_shares(w, half) == [weights // 2, weights - weights // 2, 0]
    assert sequential_shares(w, machine(2, gpu_bytes=beside)) == [0, weights]  # over every cap: the last holds it
