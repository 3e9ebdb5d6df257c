"""Tests of wandistiller/placements/balanced.py, one teacher per node spread evenly by accelerate: it needs no strategy
of the user's, plans an even spread over every GPU of the node, and refuses a machine without one."""

from __future__ import annotations

import pytest

from tests.conftest import BF16
from tests.placements.test_memory import machine, tiny_workload
from wandistiller.core.distributed import World, gpu_count
from wandistiller.core.errors import UserError
from wandistiller.placements import memory
from wandistiller.placements.balanced import BalancedPlacement

ONE = World(nproc_per_node=1, nnodes=1)


@pytest.mark.skipif(gpu_count() > 0, reason="checks the refusal on a machine without a GPU")
def test_balanced_without_a_gpu_is_refused_naming_itself_and_cpu():
    with pytest.raises(UserError, match="teacher_placement=balanced spreads the teacher over GPUs .* use .*=cpu"):
        BalancedPlacement().check(BF16, ONE)


def test_balanced_is_accelerates_balanced_strategy_and_needs_none_of_the_users():
    placement = BalancedPlacement(max_memory={0: "30GiB"}, debug_cpu=True)
    placement.check(BF16, ONE)  # a device_map without a strategy is refused here
    assert (placement.strategy, placement.max_memory) == ("balanced", {0: "30GiB"})


def test_balanced_plans_an_even_spread_and_names_the_gpus_it_spreads_over():
    w, hw = tiny_workload(ranks_per_node=3), machine(3)
    estimate = BalancedPlacement().estimate(w, hw)
    share, student = memory.teacher_weight_bytes(w) // 3, memory.student_device_bytes(w)
    act = memory.teacher_activation_bytes(w)  # the teacher's forward, on the GPU its inputs go to
    assert estimate.gpu_bytes == (share + act + student, share + student, share + student)
    assert estimate.note == "one teacher per node spread over 3 GPU(s)" and estimate.fits
    assert BalancedPlacement().estimate(w, machine(0)).note == "needs a GPU"
