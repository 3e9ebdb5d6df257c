"""`wandistiller.plan`: its `main()` called in-process on argv as a user types it: the planner's table and its
choice for hardware described on paper, the usage text, and a refusal as one line with exit code 2."""

from __future__ import annotations

import sys

import pytest

from wandistiller import plan


def plan_main(monkeypatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["python -m wandistiller.plan", *argv])
    plan.main()


def test_the_plan_of_a_14b_teacher_on_one_small_gpu_is_its_table_ending_with_the_choice(monkeypatch, capsys):
    hardware = ["hardware.gpus=1", "hardware.gpu_memory_gib=16", "hardware.host_memory_gib=8"]
    plan_main(monkeypatch, "teacher=wan2.1_t2v_14b", *hardware)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("teacher wan2.1_t2v_14b: 1 expert(s), 53.2 GiB of weights")
    assert lines[1].startswith("hardware: 1 GPU(s) of 16 GiB free, 8 GiB host RAM available")
    rows = {line.split()[0]: line.split()[1] for line in lines if line.split()[1:2] in (["yes"], ["no"])}
    assert rows["gpu"] == "no" and rows["disk"] == "yes"  # 53 GiB of weights stream from disk, never all in RAM
    assert rows.keys() >= {"gpu", "gpu0", "balanced", "sequential", "sharded", "offload", "disk", "cpu"}
    assert lines[-1] == "auto would choose: disk"


def test_help_prints_the_usage_without_composing_anything(monkeypatch, capsys):
    plan_main(monkeypatch, "--help", "teacher_placement=nowhere")  # the override is never read
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m wandistiller.plan [OVERRIDE ...]") and "hardware.gpus=N" in out


def test_a_teacher_without_a_local_config_is_one_line_and_exit_code_2(monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        plan_main(monkeypatch, "teacher.builtin=null", f"teacher.path={tmp_path / 'none'}")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err == f"error: teacher.path='{tmp_path / 'none'}': no local config.json to plan from; download it first\n"
