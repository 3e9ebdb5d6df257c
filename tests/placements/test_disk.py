"""Tests of wandistiller/placements/disk.py, the teacher streamed from its safetensors files: it needs no GPU, ranks
last without one, plans no copy of the teacher in RAM, and streams from the expert's own folder unless converting."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import BF16, FP32, metrics_steps, run_cli
from tests.placements.test_memory import machine, tiny_workload
from wandistiller.core.distributed import Topology, World
from wandistiller.core.errors import UserError
from wandistiller.placements import memory
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.placements.disk import DiskPlacement
from wandistiller.placements.offload import OffloadPlacement
from wandistiller.train import run


@pytest.mark.slow  # a whole run: the default lane keeps its 4 minutes
def test_a_disk_teacher_trains_on_the_cpu(make_cfg, tmp_path):
    summary = run(make_cfg("teacher_placement=disk", "teacher=tiny_moe", "trainer.max_steps=3", run_dir=tmp_path / "r"))
    assert summary["placement"] == "disk" and summary["steps_run"] == 3
    assert summary["copy_ms_median"] > 0  # the time spent streaming blocks, per step


# A K=2 dmd student with a LoRA fake score on the placed teacher (two updates per step), every step logged.
DMD_LORA = ["method=dmd", "method.steps=2", "method.fake_updates=2", "method.fake_score=lora", "method.lora_rank=4",
            "trainer.batch_size=2", "trainer.log_every=1", "trainer.max_steps=3"]  # fmt: skip
CURVE = ("loss", "loss_dmd", "loss_fake_score", "grad_norm")


@pytest.mark.slow
@pytest.mark.parametrize("teacher", ["tiny", "tiny_moe"])
def test_a_lora_fake_score_through_a_disk_teacher_gives_the_cpu_teachers_loss_curve(make_cfg, tmp_path, teacher):
    """Backward through the streamed teacher (each block read again and recomputed) equals the resident one bit for
    bit (tests/placements/test_streaming.py), so the whole run's curve does too (issue 34's target 6)."""
    curves = {}
    for placement in ("cpu", "disk"):
        folder = tmp_path / placement
        summary = run(make_cfg(*DMD_LORA, f"teacher={teacher}", f"teacher_placement={placement}", run_dir=folder))
        assert summary["steps_run"] == 3 and summary["placement"] == placement
        curves[placement] = torch.tensor([[r[k] for k in CURVE] for r in metrics_steps(folder)], dtype=torch.float64)
    assert curves["cpu"].shape == (3, 4) and (curves["cpu"][:, 1:3] > 0).all()  # dmd and fake-score losses
    assert torch.equal(curves["disk"], curves["cpu"]), curves


@pytest.mark.slow
def test_two_ranks_train_a_lora_fake_score_on_their_disk_teachers_under_ddp(cache_dir, tmp_path):
    """Under DDP (the fake score on two ranks): the adapters are inputs of each recomputed block's autograd node,
    where DDP looks for the parameters a backward uses, and their gradients come back as the node's."""
    folder = tmp_path / "r"
    result = run_cli(f"hydra.run.dir={folder}", f"paths.cache_dir={cache_dir}", "logger=none", "precision=fp32",
                     "trainer.progress_bar=false", "hooks=[monitor,progress]", "hooks.monitor.val_every=0", *DMD_LORA,
                     "teacher_placement=disk", "distributed.nproc_per_node=2")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics_steps(folder)
    assert len(rows) == 3 and all(r["loss_fake_score"] > 0 and r["loss_dmd"] > 0 for r in rows)


def test_disk_needs_no_gpu_and_refuses_only_a_bad_resident_block_count():
    DiskPlacement().check(BF16, World(nproc_per_node=1, nnodes=1))
    with pytest.raises(UserError, match="teacher_placement.resident_blocks='some': use auto or a count"):
        DiskPlacement(resident_blocks="some").check(BF16, World(nproc_per_node=1, nnodes=1))


def test_without_a_gpu_disk_is_the_slowest_choice_and_with_one_it_comes_after_offload():
    assert DiskPlacement().speed(machine(0)) > CpuPlacement().speed(machine(0))
    assert OffloadPlacement().speed(machine(1)) < DiskPlacement().speed(machine(1)) < CpuPlacement().speed(machine(1))


def test_without_a_gpu_each_rank_holds_the_parts_that_never_stream_two_blocks_and_its_training():
    w, hw = tiny_workload(experts=2, ranks_per_node=3), machine(0)
    outside, block = memory.block_bytes(w.teacher_config, 2)
    estimate = DiskPlacement().estimate(w, hw)
    assert estimate.gpu_bytes == () and estimate.fits and estimate.resident_blocks is None
    assert estimate.host_bytes == 3 * (2 * (outside + 2 * block) + memory.host_training_bytes(w, hw))


def test_on_a_gpu_disk_streams_as_offload_does_without_its_pinned_copy_of_the_teacher():
    w, hw = tiny_workload(ranks_per_node=2), machine(2)
    disk = DiskPlacement(resident_blocks=1).estimate(w, hw)
    offload = OffloadPlacement(resident_blocks=1).estimate(w, hw)
    assert disk.gpu_bytes == offload.gpu_bytes and disk.resident_blocks == offload.resident_blocks == 1
    _, block = memory.block_bytes(w.teacher_config, 2)
    assert disk.host_bytes == 2 * (2 * block + memory.host_process_bytes(hw))
    streamed = w.experts * (w.teacher_config["num_layers"] - 1) * block  # offload pins only the blocks it streams
    assert offload.host_bytes - disk.host_bytes == streamed - 2 * block


def test_without_an_offload_dir_disk_streams_from_the_experts_own_folder(tiny_path):
    folder = tiny_path / "transformer"
    assert DiskPlacement().expert_folder(folder, FP32, Topology()) == folder
    assert DiskPlacement().expert_folder(folder, BF16, Topology()) == folder  # converted as each block streams
