"""Tests of wandistiller/placements/gpu0.py, the teacher on GPU 0 in its own process: its refusals (GPUs, then
processes), its serving mode, and its estimate (teacher on GPU 0, students on the others), called directly."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import BF16
from tests.placements.test_memory import machine, tiny_workload
from tests.placements.test_planner import estimates_for
from wandistiller.core.distributed import Topology, World, gpu_count
from wandistiller.core.errors import UserError
from wandistiller.placements import memory
from wandistiller.placements.base import Serving
from wandistiller.placements.gpu0 import Gpu0Placement


def test_gpu0_leaves_the_student_gpus_free_of_teacher_weights(make_cfg):
    estimates, _ = estimates_for(make_cfg, "wan2.1_t2v_14b", "4x80GiB")
    gpu0 = next(e for e in estimates if e.placement == "gpu0")
    # The student GPUs hold a student (about 10 GB at b4 x 1560 tokens), none of the 28.6 GB of teacher weights.
    assert gpu0.fits and gpu0.gpu_bytes[0] > 28e9 and all(b < 14e9 for b in gpu0.gpu_bytes[1:])


@pytest.mark.skipif(gpu_count() > 0, reason="checks the refusal on a machine without a GPU")
def test_gpu0_without_two_gpus_is_refused_before_asking_for_processes():
    with pytest.raises(UserError, match=r"needs 2 or more GPUs .* has 0; use teacher_placement=cpu"):
        Gpu0Placement().check(BF16, World(nproc_per_node=1, nnodes=1))


def test_gpu0_asks_for_a_process_per_student_gpu_unless_the_owner_trains_too():
    with pytest.raises(UserError, match=r"set distributed.nproc_per_node to 1 \+ the number of student GPUs"):
        Gpu0Placement(debug_cpu=True).check(BF16, World(nproc_per_node=1, nnodes=1))
    Gpu0Placement(debug_cpu=True).check(BF16, World(nproc_per_node=2, nnodes=1))
    Gpu0Placement(train_on_owner=True, debug_cpu=True).check(BF16, World(nproc_per_node=1, nnodes=1))


def test_the_owner_serves_from_a_dedicated_process_unless_it_trains_too():
    assert Gpu0Placement().serving == Serving.DEDICATED_OWNER
    assert Gpu0Placement(train_on_owner=True).serving == Serving.NODE_OWNER
    assert Gpu0Placement(debug_cpu=True).teacher_device(Topology(local_rank=1)) == torch.device("cpu")
    assert Gpu0Placement().teacher_device(Topology(local_rank=1)) == torch.device("cuda", 0)


def test_gpu0_plans_the_whole_teacher_on_gpu_0_and_a_student_on_each_other_gpu():
    w = tiny_workload(ranks_per_node=4)
    assert Gpu0Placement().estimate(w, machine(1)) == memory.Estimate.refused("gpu0", "needs 2 or more GPUs")
    estimate = Gpu0Placement().estimate(w, machine(8))
    owner = memory.teacher_weight_bytes(w) + memory.teacher_activation_bytes(w) + memory.CUDA_CONTEXT
    assert estimate.gpu_bytes == (owner,) + (memory.student_device_bytes(w),) * 3  # 4 ranks: 1 owner, 3 students
    assert estimate.host_bytes == 4 * memory.host_process_bytes(machine(8)) and estimate.fits
    assert estimate.note == "teacher on GPU 0, 3 student rank(s) on GPUs 1..3"
