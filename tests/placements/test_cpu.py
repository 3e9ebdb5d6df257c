"""Tests of wandistiller/placements/cpu.py, one teacher per node in host RAM: its fp16 refusal, its estimate (one
teacher, every rank's process beside it) on plain Workload/Hardware, and where it computes."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import BF16, FP32
from tests.placements.test_memory import machine, tiny_workload
from wandistiller.core.distributed import Topology, World
from wandistiller.core.errors import UserError
from wandistiller.core.precision import Precision
from wandistiller.placements import memory
from wandistiller.placements.base import Serving
from wandistiller.placements.cpu import CpuPlacement

FP16 = Precision("fp16", torch.float16, torch.float32, torch.float16)
ONE = World(nproc_per_node=1, nnodes=1)


def test_cpu_refuses_an_fp16_teacher_naming_the_precisions_it_runs():
    with pytest.raises(UserError, match="teacher_placement=cpu cannot run an fp16 teacher; use precision=bf16"):
        CpuPlacement().check(FP16, ONE)
    CpuPlacement().check(BF16, ONE)
    CpuPlacement().check(FP32, ONE)


def test_cpu_plans_one_teacher_per_node_and_a_process_per_rank_beside_it():
    w, hw = tiny_workload(ranks_per_node=3), machine(0)
    estimate = CpuPlacement().estimate(w, hw)
    others = memory.host_training_bytes(w, hw, teacher_here=False)
    owner = memory.teacher_weight_bytes(w) + memory.host_training_bytes(w, hw)
    assert estimate.gpu_bytes == () and estimate.host_bytes == owner + 2 * others and estimate.fits
    # The teacher's forward runs on the owner only: at a large teacher batch, only its process grows.
    whole_step = tiny_workload(ranks_per_node=3, teacher_batch_size=64)
    grown = CpuPlacement().estimate(whole_step, hw).host_bytes - estimate.host_bytes
    assert grown == memory.host_training_bytes(whole_step, hw) - memory.host_training_bytes(w, hw) > 0


def test_on_a_gpu_machine_the_students_train_on_the_gpus_while_the_teacher_stays_in_ram():
    w = tiny_workload(ranks_per_node=2)
    estimate = CpuPlacement().estimate(w, machine(4))
    assert estimate.gpu_bytes == (memory.student_device_bytes(w),) * 2  # one per rank, not per GPU
    assert CpuPlacement().serving == Serving.NODE_OWNER
    assert CpuPlacement().teacher_device(Topology(rank=1, local_rank=1)) == torch.device("cpu")
