"""The planner: what `auto` picks for a table of hardware, and what it refuses."""

from __future__ import annotations

import pytest
from conftest import ROOT

from wandistiller import plan
from wandistiller.errors import UserError
from wandistiller.precision import DTYPES, Precision
from wandistiller.train import choose_placement

BF16 = Precision("bf16", DTYPES["bf16"], DTYPES["fp32"], DTYPES["bf16"])
FRAME = ["data.latent_height=60", "data.latent_width=104", "student=small", "precision=bf16"]
HARDWARE = {
    "1x24GiB": ["hardware.gpus=1", "hardware.gpu_memory_gib=24", "hardware.host_memory_gib=256"],
    "1x80GiB": ["hardware.gpus=1", "hardware.gpu_memory_gib=80", "hardware.host_memory_gib=256"],
    "4x80GiB": ["hardware.gpus=4", "hardware.gpu_memory_gib=80", "hardware.host_memory_gib=512"],
    "8x40GiB": ["hardware.gpus=8", "hardware.gpu_memory_gib=40", "hardware.host_memory_gib=512"],
    "cpu-only": ["hardware.gpus=0", "hardware.gpu_memory_gib=0", "hardware.host_memory_gib=256"],
}
EXPECTED = {  # (teacher, hardware) -> auto's choice
    ("wan2.1_t2v_14b", "1x24GiB"): "offload",
    ("wan2.1_t2v_14b", "1x80GiB"): "gpu",
    ("wan2.1_t2v_14b", "4x80GiB"): "gpu",
    ("wan2.1_t2v_14b", "8x40GiB"): "gpu",
    ("wan2.1_t2v_14b", "cpu-only"): "cpu",
    ("wan2.2_t2v_a14b", "1x24GiB"): "offload",
    ("wan2.2_t2v_a14b", "1x80GiB"): "gpu",
    ("wan2.2_t2v_a14b", "4x80GiB"): "gpu",
    ("wan2.2_t2v_a14b", "8x40GiB"): "balanced",
    ("wan2.2_t2v_a14b", "cpu-only"): "cpu",
}


def estimates_for(make_cfg, teacher, hardware, *extra):
    cfg = make_cfg(f"teacher={teacher}", *FRAME, *HARDWARE[hardware], *extra)
    found = plan.planning_teacher_config(cfg.teacher)
    hw = plan.Hardware.detect(cfg.hardware)
    return plan.plan(plan.workload(cfg, *found, DTYPES["bf16"]), hw, plan.ranks_per_node(cfg, hw)), cfg


@pytest.mark.parametrize("teacher,hardware", sorted(EXPECTED))
def test_auto_picks_the_fastest_placement_that_fits(make_cfg, teacher, hardware):
    estimates, cfg = estimates_for(make_cfg, teacher, hardware)
    assert plan.choose(estimates).placement == EXPECTED[teacher, hardware]
    auto = make_cfg(f"teacher={teacher}", *FRAME, *HARDWARE[hardware], "teacher_placement=auto")
    resolved, table = choose_placement(auto, BF16)
    assert resolved["_target_"].endswith(
        {"cpu": "CpuPlacement", "gpu": "GpuPlacement", "balanced": "DeviceMapPlacement", "offload": "StreamPlacement"}[
            EXPECTED[teacher, hardware]
        ]
    )
    assert f"{EXPECTED[teacher, hardware]:<11}" in table and "<- chosen" in table


def test_the_14b_expert_weighs_what_its_parameters_say(make_cfg):
    estimates, cfg = estimates_for(make_cfg, "wan2.1_t2v_14b", "1x80GiB")
    w = plan.workload(cfg, *plan.planning_teacher_config(cfg.teacher), DTYPES["bf16"])
    assert 14.2e9 < plan.param_count(w.teacher_config) < 14.4e9  # Wan 14B
    assert abs(plan.teacher_weight_bytes(w) / 1e9 - 28.6) < 0.1


def test_gpu0_leaves_the_student_gpus_free_of_teacher_weights(make_cfg):
    estimates, _ = estimates_for(make_cfg, "wan2.1_t2v_14b", "4x80GiB")
    gpu0 = next(e for e in estimates if e.placement == "gpu0")
    assert gpu0.fits and gpu0.gpu_bytes[0] > 28e9 and all(b < 10e9 for b in gpu0.gpu_bytes[1:])


def test_a_placement_that_cannot_fit_is_refused_naming_one_that_can(make_cfg):
    # A 14B teacher in 16 GiB of host RAM will not fit; the 80 GiB GPU would hold it.
    cfg = make_cfg(
        "teacher=wan2.1_t2v_14b",
        *FRAME,
        "hardware.gpus=1",
        "hardware.gpu_memory_gib=80",
        "hardware.host_memory_gib=16",
        "teacher_placement=cpu",
    )
    with pytest.raises(
        UserError, match=r"teacher_placement=cpu will not fit: .*GiB host RAM.*use teacher_placement=gpu"
    ):
        choose_placement(cfg, BF16)


def test_plan_cli_prints_the_table_for_hardware_described_on_paper():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "wandistiller.plan", "teacher=wan2.2_t2v_a14b", *FRAME, *HARDWARE["8x40GiB"]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "auto would choose: balanced" in result.stdout and "8 GPU(s) of 40 GiB" in result.stdout
