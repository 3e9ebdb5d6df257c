"""Tests of wandistiller/placements/gpu.py, a full teacher on every rank's GPU: its refusal on a machine without one and
its estimate on plain Workload/Hardware (the GPU case is planned on paper; loading on a GPU is tests/test_gpu.py's)."""

from __future__ import annotations

import pytest

from tests.conftest import BF16
from tests.placements.test_memory import machine, tiny_workload
from wandistiller.core.distributed import World, gpu_count
from wandistiller.core.errors import UserError
from wandistiller.placements import memory
from wandistiller.placements.gpu import GpuPlacement


@pytest.mark.skipif(gpu_count() > 0, reason="checks the refusal on a machine without a GPU")
def test_gpu_without_a_gpu_is_refused_naming_cpu():
    with pytest.raises(UserError, match="teacher_placement=gpu needs a CUDA GPU and none is visible; use .*=cpu"):
        GpuPlacement().check(BF16, World(nproc_per_node=1, nnodes=1))


def test_gpu_is_planned_only_where_there_is_one():
    assert GpuPlacement().estimate(tiny_workload(), machine(0)) == memory.Estimate.refused("gpu", "needs a GPU")


def test_gpu_plans_a_whole_teacher_beside_the_student_on_each_ranks_gpu():
    w, hw = tiny_workload(ranks_per_node=3), machine(8)
    estimate = GpuPlacement().estimate(w, hw)
    per_gpu = memory.teacher_weight_bytes(w) + memory.beside_teacher_bytes(w)
    assert estimate.gpu_bytes == (per_gpu,) * 3 and estimate.host_bytes == 3 * memory.host_process_bytes(hw)
    assert len(GpuPlacement().estimate(tiny_workload(ranks_per_node=4), machine(2)).gpu_bytes) == 2  # ranks share
    full = machine(1, gpu_bytes=per_gpu, headroom_fraction=0.0)
    assert GpuPlacement().estimate(w, full).fits and not GpuPlacement().estimate(w, machine(1, per_gpu - 1)).fits
