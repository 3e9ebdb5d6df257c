"""The table of rigs in docs/PLANNER.md (wandistiller/bench/rigs.py): every documented cell is what the planner says
now, and `plan` on a rig where the asked run does not fit names what would, or says in one line what is short."""

from __future__ import annotations

import pytest

from tests.test_plan import plan_main
from wandistiller.bench import rigs

GRID = {
    (t, b, f, g, h)
    for t in rigs.TEACHERS
    for b in rigs.BASES
    for f in rigs.CLIPS
    for g in rigs.GPUS
    for h in rigs.HOSTS
}  # fmt: skip


def test_every_documented_rig_is_what_the_planner_says_now():
    documented = rigs.documented()
    assert documented.keys() == GRID  # the whole grid is documented, nothing else
    for teacher, base, frames in {(t, b, f) for t, b, f, _, _ in GRID}:
        w, passes = rigs.workload(teacher, base, frames)
        for gpu in rigs.GPUS:
            for host in rigs.HOSTS:
                key = (teacher, base, frames, gpu, host)
                assert documented[key] == rigs.cell(w, passes, gpu, host, frames), (
                    f"docs/PLANNER.md's rig {key} no longer matches plan: python -m wandistiller.plan --rigs --write"
                )


def test_the_headline_the_a14b_pair_with_an_fp8_base_plans_on_24_gib_and_64_gib():
    cells = rigs.documented()
    assert cells["wan2.2_t2v_a14b", "fp8", 1, 24, 64].startswith("yes ")
    assert cells["wan2.2_t2v_a14b", "bf16", 1, 24, 64].startswith("yes ")  # the pinned bf16 pair: 55.9 GiB of 58.9
    assert cells["wan2.2_t2v_a14b", "bf16", 1, 24, 32].startswith("no; disk")  # not pinned in 32 GiB: from disk


def test_issue_43_target_2_the_a14b_pairs_lora_dmd_on_an_fp8_base_plans_within_24_gib_gpu_and_48_gib_host():
    from wandistiller.placements.memory import GiB, Hardware
    from wandistiller.placements.offload import OffloadPlacement
    from wandistiller.placements.planner import plan

    w, _ = rigs.workload("wan2.2_t2v_a14b", "fp8", 1)
    assert (
        w.teacher_fp8 and w.student_lora_rank and w.networks[0].shape == "adapters"
    )  # a run that now trains (no refusal)
    mine = next(e for e in plan(w, Hardware((24 * GiB,), 48 * GiB), OffloadPlacement()) if e.placement == "offload")
    assert mine.fits and max(mine.gpu_bytes) <= 24 * GiB and mine.host_bytes <= 48 * GiB  # the host at fp8 bytes


HW = ["hardware.gpus=1", "hardware.host_memory_gib=64"]
LORA = ["teacher=wan2.2_t2v_a14b", *rigs.RUN[:5], "data.latent_height=60", "data.latent_width=104"]


def test_a_run_that_does_not_fit_is_told_what_would(monkeypatch, capsys):
    plan_main(monkeypatch, *LORA, *HW, "hardware.gpu_memory_gib=24", "trainer.batch_size=2",
              "teacher_placement.resident_blocks=30")  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert "teacher_placement=offload would fit with any one of: teacher_placement.resident_blocks=8" in lines


def test_a_run_that_fits_nothing_alone_is_told_the_overrides_that_fit_together(monkeypatch, capsys):
    plan_main(monkeypatch, *LORA, *HW, "hardware.gpu_memory_gib=12", "trainer.batch_size=3",
              "teacher_placement.resident_blocks=20")  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    line = ("teacher_placement=offload would fit with all of: teacher_placement.resident_blocks=0 trainer.batch_size=1 "
            "teacher.quantize=fp8")  # fp8: a LoRA run takes an fp8 base  # fmt: skip
    assert line in lines and lines[-1] == "nothing fits as asked: see what would, above"  # at batch 3


def test_a_student_network_that_does_not_fit_is_told_fp8_would(monkeypatch, capsys):
    # kd into student=small beside a resident 14B teacher: the bf16 teacher (26.6 GiB) does not fit 32 GiB, fp8 does
    plan_main(monkeypatch, "teacher=wan2.1_t2v_14b", "student=small", "precision=bf16", "teacher_placement=gpu",
              "hardware.gpus=1", "hardware.gpu_memory_gib=32", "hardware.host_memory_gib=256")  # fmt: skip
    assert "teacher_placement=gpu would fit with any one of: teacher.quantize=fp8" in capsys.readouterr().out


def test_a_rig_no_setting_fits_is_one_line_saying_what_is_short_and_exit_2(monkeypatch, capsys):
    with pytest.raises(SystemExit) as stop:
        plan_main(monkeypatch, *LORA, *HW, "hardware.gpu_memory_gib=4", "trainer.batch_size=2", "data.latent_frames=5")
    captured = capsys.readouterr()
    assert stop.value.code == 2 and captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(
        "error: teacher=wan2.2_t2v_a14b hardware.gpus=1 hardware.gpu_memory_gib=4 hardware.host_memory_gib=64: no "
        "setting fits 1 GPU(s) of 4 GiB free, 64 GiB host RAM available, not even trainer.batch_size=1 "
        "data.latent_frames=1 teacher.quantize=fp8: the closest, teacher_placement="
    )
    assert " GiB of GPU 0 (3.7 usable); use a GPU or host with that much more memory\n" in captured.err


def test_the_rig_table_is_printed_by_plan_and_takes_no_overrides(monkeypatch, capsys):
    monkeypatch.setattr(rigs, "table", lambda: "the table")
    plan_main(monkeypatch, "--rigs")
    assert capsys.readouterr().out == "the table\n"
    with pytest.raises(SystemExit) as stop:
        plan_main(monkeypatch, "--rigs", "teacher=tiny")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: --rigs takes no overrides (teacher=tiny)")
