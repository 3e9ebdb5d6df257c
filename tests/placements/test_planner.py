"""Tests of wandistiller/placements/planner.py: what `auto` picks for a table of hardware (composed by Hydra, planned on
paper), what it refuses, and the table `python -m wandistiller.plan` prints."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import choose, workload
from wandistiller.core.arch import WAN_14B
from wandistiller.core.errors import UserError
from wandistiller.core.precision import DTYPES
from wandistiller.placements import advice, memory
from wandistiller.placements import planner as plan
from wandistiller.placements.offload import OffloadPlacement
from wandistiller.placements.steptime import Passes

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
    ("wan2.2_t2v_a14b", "8x40GiB"): "sharded",  # 27.8 samples/s against balanced's 3.54 (and offload's 27.8)
    ("wan2.2_t2v_a14b", "cpu-only"): "cpu",
}


def estimates_for(make_cfg, teacher, hardware, *extra):
    cfg = make_cfg(f"teacher={teacher}", *FRAME, *HARDWARE[hardware], *extra)
    w, hw = workload(cfg)
    return plan.plan(w, hw), cfg


def kd_times(estimates, cfg):
    w, hw = workload(cfg)
    return plan.step_times(estimates, w, hw, Passes("kd", micro_batches=1, teacher_calls=1, student_forwards=0,
                                                    student_trains=1))  # fmt: skip


@pytest.mark.parametrize("teacher,hardware", sorted(EXPECTED))
def test_auto_picks_the_fastest_placement_that_fits(make_cfg, teacher, hardware):
    estimates, cfg = estimates_for(make_cfg, teacher, hardware)
    assert plan.choose(estimates, kd_times(estimates, cfg)).placement == EXPECTED[teacher, hardware]
    auto = make_cfg(f"teacher={teacher}", *FRAME, *HARDWARE[hardware], "teacher_placement=auto")
    resolved, table = choose(auto)
    assert resolved.name == EXPECTED[teacher, hardware]
    assert f"{EXPECTED[teacher, hardware]:<11}" in table and "<- chosen" in table


def test_auto_takes_the_placement_its_own_table_times_fastest_the_speed_order_only_between_equals(make_cfg):
    # The two-expert 14B teacher over 8 x 40 GiB: balanced fits and comes first in the speed order, but the table
    # times it at 9 s/step (one teacher serving 8 ranks in turn) against sharded's 1.15: auto said balanced.
    estimates, cfg = estimates_for(make_cfg, "wan2.2_t2v_a14b", "8x40GiB")
    times = kd_times(estimates, cfg)
    fitting = [e.placement for e in estimates if e.fits]
    assert fitting.index("balanced") < fitting.index("sharded") and plan.choose(estimates).placement == "balanced"
    assert times["balanced"].seconds > 5 * times["sharded"].seconds
    assert plan.choose(estimates, times).placement == "sharded"
    # offload's figures equal sharded's: the speed order breaks the tie; untimed ones come after every timed one
    assert f"{times['offload'].samples_per_s:.3g}" == f"{times['sharded'].samples_per_s:.3g}"
    order = [e.placement for e in plan.fastest_first(estimates, times)]
    assert order.index("sharded") < order.index("offload") < order.index("balanced")
    untimed = {name: t for name, t in times.items() if name != "sharded"}
    assert [e.placement for e in plan.fastest_first(estimates, untimed)][-1] == "sharded"


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
        choose(cfg)


def test_auto_with_a_headroom_that_excludes_its_first_choice_picks_the_next_and_says_why(make_cfg, caplog):
    # A 14B teacher beside the small student needs ~36 GiB: it fits 80 GiB, not 80 less a 50 GiB headroom.
    hardware = ["hardware.gpus=1", "hardware.gpu_memory_gib=80", "hardware.host_memory_gib=256"]
    cfg = make_cfg("teacher=wan2.1_t2v_14b", *FRAME, *hardware, "teacher_placement=auto")
    assert choose(cfg)[0].name == "gpu"
    cfg = make_cfg("teacher=wan2.1_t2v_14b", *FRAME, *hardware, "hardware.headroom_gib=50", "teacher_placement=auto")
    with caplog.at_level("INFO", logger="wandistiller"):
        placement, table = choose(cfg)
    assert placement.name == "offload"
    why = [r.getMessage() for r in caplog.records if "headroom excludes" in r.getMessage()]
    assert why and why[0].startswith("teacher_placement=auto: not gpu, the headroom excludes it: needs ")
    assert "80.0 GiB free less 50.0 GiB headroom leaves 30.0" in why[0]
    assert "the larger of 50 GiB and 8% of each device" in table and "offload     yes" in table


def test_a_named_placement_the_headroom_excludes_is_refused(make_cfg):
    # The 14B teacher in host RAM needs ~31 GiB: it fits 40 GiB less 8%, not 40 less a 20 GiB headroom.
    hardware = ["hardware.gpus=1", "hardware.gpu_memory_gib=80", "hardware.host_memory_gib=40"]
    choose(make_cfg("teacher=wan2.1_t2v_14b", *FRAME, *hardware, "teacher_placement=cpu"))
    cfg = make_cfg("teacher=wan2.1_t2v_14b", *FRAME, *hardware, "hardware.headroom_gib=20", "teacher_placement=cpu")
    with pytest.raises(UserError, match="teacher_placement=cpu will not fit"):
        choose(cfg)


def test_every_no_row_that_ran_out_of_memory_says_which_device_is_short_and_by_how_much(make_cfg):
    estimates, cfg = estimates_for(make_cfg, "wan2.2_t2v_a14b", "8x40GiB", "hardware.host_memory_gib=16")
    w, hw = workload(cfg)
    table = plan.format_table(estimates, hw, "balanced", w)
    cpu = next(r for r in table.splitlines() if r.startswith("cpu "))
    # ~70 GiB of host RAM wanted, 16 less 8% headroom = 14.7 usable.
    assert " no " in cpu and "short of" in cpu and "GiB on host RAM, 14.7 usable" in cpu
    for e in estimates:
        row = next(r for r in table.splitlines() if r.startswith(f"{e.placement} "))
        assert e.fits or "short of" in row or "needs" in row or "headroom" in row, row


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
    placement, table = choose(cfg)
    assert placement.name == "disk" and "offload     no" in table  # 28.6 GB of pinned RAM do not fit in 16
    outside, block = memory.block_bytes(WAN_14B, 2)
    assert 40 * block + outside == pytest.approx(28.6e9, rel=0.01) and outside < 0.02 * 28.6e9
    kept = [memory.resident_blocks(WAN_14B, 1, DTYPES["bf16"], gib * memory.GiB) for gib in (6, 24, 40, 80)]
    assert kept[0] == 0 and kept == sorted(kept) and kept[-1] == 40


def test_the_planner_refuses_to_shard_an_fp8_teacher():
    from tests.placements.test_memory import machine, tiny_workload  # test_memory imports this module

    w = dataclasses.replace(tiny_workload(ranks_per_node=2), teacher_fp8=True)
    sharded = next(e for e in plan.plan(w, machine(2)) if e.placement == "sharded")
    assert not sharded.fits and sharded.note == "cannot load an fp8 teacher (teacher.quantize=fp8)"


LORA_DMD = ["method=dmd", "method.fake_score=lora", "teacher_placement=offload", "precision=bf16"]


def lora_student_workload(make_cfg, teacher: str, *extra: str, rank: int = 16, layers="all"):
    """(Workload, Hardware) of `student=lora` (builder lora, rank `rank`: the node branch lorastudent's YAML holds),
    dmd with a LoRA fake score, batch 1, one 480x832 frame (1560 tokens), on one 24 GiB GPU."""
    from omegaconf import OmegaConf

    from wandistiller.job.checks import method_passes

    cfg = make_cfg(f"teacher={teacher}", *FRAME, *HARDWARE["1x24GiB"], *LORA_DMD, "trainer.batch_size=1", *extra)
    passes = method_passes(cfg)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # a plain node: the student's keys change
    cfg.student = {"builder": "lora", "rank": rank, "alpha": None, "layers": layers}
    found = plan.workload_of(cfg, DTYPES["bf16"], passes.networks)
    assert found is not None
    return found


def test_a_lora_student_is_read_from_its_config_as_the_teacher_with_adapters(make_cfg):
    w, _ = lora_student_workload(make_cfg, "wan2.1_t2v_14b", rank=8)
    assert (w.student_lora_rank, w.student_config, w.tokens, w.batch_size) == (8, dict(WAN_14B), 1560, 1)
    assert memory.student_params(w) == 8 * (18 * 5120 + 2 * 13824) * 40  # adapters alone: no weights of its own
    assert [(n.shape, n.rank) for n in w.networks] == [(memory.ADAPTERS, 16)]  # dmd's LoRA fake score, declared
    attention, _ = lora_student_workload(make_cfg, "wan2.1_t2v_14b", rank=8, layers="attention")
    assert memory.student_params(attention) == 8 * (16 * 5120) * 40  # 8 projections of 5120 x 5120
    named, _ = lora_student_workload(make_cfg, "wan2.1_t2v_14b", rank=8, layers=["ffn.net.2", "attn1.to_q"])
    assert memory.student_params(named) == 8 * (13824 + 5120 + 2 * 5120) * 40


@pytest.mark.parametrize("teacher,experts", [("wan2.1_t2v_14b", 1), ("wan2.2_t2v_a14b", 2)])
def test_a_lora_student_of_a_14b_teacher_streamed_by_offload_fits_one_24_gib_gpu(make_cfg, teacher, experts):
    w, hw = lora_student_workload(make_cfg, teacher)
    estimates = {e.placement: e for e in plan.plan(w, hw)}
    auto, bare = estimates["offload"], plan._estimate(OffloadPlacement(resident_blocks=0), w, hw)
    # Resident blocks fill what is left of 24 GiB (less its 8% headroom); with none kept it needs well under.
    assert auto.fits and max(auto.gpu_bytes) <= hw.usable(24 * memory.GiB) and auto.resident_blocks > 0
    assert bare.fits and max(bare.gpu_bytes) < 10.5 * memory.GiB
    # host: the pinned bf16 teacher (28.6 GB a expert) and the process; the GPU holds two adapter sets + states
    assert memory.teacher_weight_bytes(w) < bare.host_bytes < memory.teacher_weight_bytes(w) + 3 * memory.GiB
    assert w.experts == experts and memory.student_params(w) == memory.network_params(w, *w.networks)
    # Only placements that backpropagate through the teacher on the GPU are planned; `gpu` does not fit
    refused = {n for n, e in estimates.items() if not (e.gpu_bytes or e.host_bytes)}
    assert {"balanced", "sequential", "sharded", "gpu0", "cpu"} <= refused and not estimates["gpu"].fits
    assert estimates["balanced"].note == (
        "cannot backpropagate through its teacher on the training device (student=lora, method.fake_score=lora)"
    )
    # fp8 weights stream half the bytes: less GPU (slots) and half the pinned host RAM
    fp8 = plan._estimate(OffloadPlacement(resident_blocks=0), dataclasses.replace(w, teacher_fp8=True), hw)
    assert max(fp8.gpu_bytes) < max(bare.gpu_bytes) and fp8.host_bytes < 0.6 * bare.host_bytes


def test_the_plan_of_a_lora_student_names_its_adapters_and_streams_its_teacher(make_cfg):
    import torch
    from omegaconf import OmegaConf

    from wandistiller.job.checks import method_passes

    cfg = make_cfg("teacher=wan2.1_t2v_14b", *FRAME, *HARDWARE["1x24GiB"], *LORA_DMD, "trainer.batch_size=1")
    passes = method_passes(cfg)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    cfg.student = {"builder": "lora", "rank": 16, "alpha": None, "layers": "all"}
    planned = plan.workload_of(cfg, torch.bfloat16, passes.networks)
    assert planned is not None
    report = advice.plan_report(*planned, cfg.teacher.name, passes).splitlines()
    assert "student LoRA of rank 16 on the teacher's 1 expert(s), 76.7M adapter params" in report[0]
    assert report[-1] == "auto would choose: offload"
    row = next(line for line in report if line.startswith("offload"))
    assert row.split()[1] == "yes" and "blocks resident" in row
