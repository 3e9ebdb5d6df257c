"""Streamed teachers (offload, disk): the same targets as a resident teacher, and what the planner makes of them."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from wandistiller import plan
from wandistiller.distributed import Topology
from wandistiller.errors import UserError
from wandistiller.placement import CpuPlacement, StreamPlacement
from wandistiller.precision import DTYPES, Precision
from wandistiller.teacher import inspect_teacher
from wandistiller.train import choose_placement, run

BF16 = Precision("bf16", DTYPES["bf16"], DTYPES["fp32"], DTYPES["bf16"])
TEACHER = OmegaConf.create({"guidance_scale": 4.0, "guidance_scale_2": 3.0})


@pytest.mark.parametrize("source", ["host", "disk"])
@pytest.mark.parametrize("resident", [0, 2])
def test_a_streamed_teacher_gives_the_resident_teachers_targets_bit_for_bit(tiny_moe_path, source, resident):
    # (offload refuses a machine without a GPU at check(); its streaming code runs on the CPU here.)
    spec = inspect_teacher(tiny_moe_path)
    resident_teacher = CpuPlacement().load(spec, TEACHER, BF16, Topology())
    streamed = StreamPlacement(source=source, resident_blocks=resident)
    streamed.teacher_device = lambda topology: torch.device("cpu")  # compute where the reference does
    teacher = streamed.load(spec, TEACHER, BF16, Topology())
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(4, 16, 1, 8, 8, generator=g), torch.randn(4, 512, 32, generator=g)
    t, uncond = torch.tensor([950.0, 100.0, 880.0, 300.0]), torch.zeros(4, 512, 32)
    for _ in range(3):  # the streamer wraps around from the last block to the first between forwards
        got, got_hidden = teacher.targets(x, t, cond, uncond, want_hidden=True)
        want, want_hidden = resident_teacher.targets(x, t, cond, uncond, want_hidden=True)
        assert torch.equal(got, want) and torch.equal(got_hidden, want_hidden)
    assert teacher.copy_ms() > 0 and teacher.copy_ms() == 0.0  # drained: counted once


def test_a_disk_teacher_trains_on_the_cpu(make_cfg, tmp_path):
    summary = run(make_cfg("teacher_placement=disk", "teacher=tiny_moe", "trainer.max_steps=3", run_dir=tmp_path / "r"))
    assert summary["placement"] == "disk" and summary["steps_run"] == 3
    assert summary["copy_ms_median"] > 0  # the time spent streaming blocks, per step


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_offload_without_a_gpu_is_refused_naming_what_to_use(make_cfg, tmp_path):
    with pytest.raises(UserError, match="teacher_placement=offload .* none is visible; use teacher_placement=cpu"):
        run(make_cfg("teacher_placement=offload", run_dir=tmp_path / "r"))


def test_the_planner_streams_when_the_teacher_does_not_fit_and_refuses_offload_without_ram(make_cfg):
    frame = ["data.latent_height=60", "data.latent_width=104", "student=small", "precision=bf16"]
    cfg = make_cfg(
        "teacher=wan2.1_t2v_14b",
        *frame,
        "hardware.gpus=1",
        "hardware.gpu_memory_gib=24",
        "hardware.host_memory_gib=16",
        "teacher_placement=auto",
    )
    placement, table = choose_placement(cfg, BF16)
    assert placement["source"] == "disk" and "offload     no" in table  # 28.6 GB of pinned RAM do not fit in 16
    config = plan.KNOWN_TEACHERS["Wan-AI/Wan2.1-T2V-14B-Diffusers"][0]
    outside, block = plan.block_bytes(config, 2)
    assert 40 * block + outside == pytest.approx(28.6e9, rel=0.01) and outside < 0.02 * 28.6e9
    kept = [plan.resident_blocks(config, 1, DTYPES["bf16"], gib * plan.GiB) for gib in (6, 24, 40, 80)]
    assert kept[0] == 0 and kept == sorted(kept) and kept[-1] == 40
