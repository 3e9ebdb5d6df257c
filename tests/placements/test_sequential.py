"""Tests of wandistiller/placements/sequential.py, one teacher per node filling GPU 0 first (accelerate): its estimate
on plain Workload/Hardware puts the teacher where `sequential_shares` says and a student on every GPU it fills."""

from __future__ import annotations

from tests.conftest import BF16
from tests.placements.test_memory import machine, tiny_workload
from wandistiller.core.distributed import World
from wandistiller.placements import memory
from wandistiller.placements.sequential import SequentialPlacement


def test_sequential_puts_the_whole_teacher_on_gpu_0_when_it_fits_there():
    w, hw = tiny_workload(), machine(3)
    student, act = memory.student_device_bytes(w), memory.teacher_activation_bytes(w)
    estimate = SequentialPlacement().estimate(w, hw)
    # Planned as if every GPU it fills also trains, though one rank was asked for.
    assert estimate.gpu_bytes == (memory.teacher_weight_bytes(w) + act + student, student, student)
    assert estimate.host_bytes == 3 * memory.host_process_bytes(hw) and estimate.note == "fills GPU 0 first"


def test_sequential_spills_onto_the_next_gpu_what_gpu_0_cannot_hold():
    w = tiny_workload()
    weights = memory.teacher_weight_bytes(w)
    beside = memory.student_device_bytes(w) + memory.teacher_activation_bytes(w)
    hw = machine(2, gpu_bytes=beside + weights // 2, headroom_fraction=0.0)
    estimate = SequentialPlacement().estimate(w, hw)
    assert estimate.gpu_bytes[0] == hw.gpu_bytes[0] and estimate.fits  # GPU 0 filled to the byte
    assert estimate.gpu_bytes[1] == weights - weights // 2 + memory.student_device_bytes(w)


def test_sequential_keeps_the_debug_layout_on_the_cpu_without_a_gpu():
    SequentialPlacement(debug_cpu=True).check(BF16, World(nproc_per_node=1, nnodes=1))
    assert SequentialPlacement().estimate(tiny_workload(), machine(0)).note == "needs a GPU"
