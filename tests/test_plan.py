"""`wandistiller.plan`: its `main()` called in-process on argv as a user types it: the planner's table and its
choice for hardware described on paper, the usage text, and a refusal as one line with exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, cli, fresh_runs
from tests.placements.test_planner import FRAME, HARDWARE
from wandistiller import plan
from wandistiller.placements import memory


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


def test_a_teacher_given_by_path_is_named_by_its_folder_not_the_default_groups(monkeypatch, capsys):
    from wandistiller.compose import shipped_asset

    plan_main(monkeypatch, f"teacher.path={shipped_asset('pocket/pocket-wan-t2v')}")
    assert capsys.readouterr().out.startswith("teacher pocket-wan-t2v: 1 expert(s)")  # was "teacher tiny"


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


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "wandistiller.plan", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module", autouse=True)  # autouse: they start with the module, beside its in-process tests
def plans(request):
    """This module's `python -m wandistiller.plan` runs, started together (each a fresh process)."""
    plan = lambda *args: cli(*args, module="wandistiller.plan")  # noqa: E731
    return fresh_runs(request, {
        "8x40": ("test_plan_cli_prints_the_table_for_hardware_described_on_paper",
                 plan("teacher=wan2.2_t2v_a14b", *FRAME, *HARDWARE["8x40GiB"])),
        "missing": ("test_plan_cli_names_a_missing_hardware_key_in_one_line",
                    plan("teacher=wan2.1_t2v_14b", "hardware.gpus=8")),
        "headroom": ("test_a_bad_headroom_is_one_line_naming_the_keys", plan("hardware.headroom_fraction=1.5")),
        "1x80": ("test_the_table_shows_its_error_bar_and_marks_extrapolated_figures",
                 plan("teacher=wan2.1_t2v_14b", *FRAME, *HARDWARE["1x80GiB"])),
    })  # fmt: skip


def test_plan_cli_prints_the_table_for_hardware_described_on_paper(plans):
    result = plans["8x40"].result()
    assert result.returncode == 0, result.stderr
    assert "auto would choose: balanced" in result.stdout and "8 GPU(s) of 40 GiB" in result.stdout


def test_plan_cli_names_a_missing_hardware_key_in_one_line(plans):
    # Regression: hardware.gpus without hardware.gpu_memory_gib ended in a TypeError traceback.
    result = plans["missing"].result()
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "hardware.gpu_memory_gib" in result.stderr


@pytest.mark.slow  # several fresh-process CLI runs
def test_plan_cli_has_help_and_refuses_a_bad_override_listing_the_options():
    assert plan_cli("--help").returncode == 0
    result = plan_cli("teacher_placement=nowhere")
    assert result.returncode == 2 and "Traceback" not in result.stderr and "offload" in result.stderr


def test_a_bad_headroom_is_one_line_naming_the_keys(plans):
    result = plans["headroom"].result()
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "hardware.headroom_fraction=1.5" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_the_table_shows_its_error_bar_and_marks_extrapolated_figures(plans):
    result = plans["1x80"].result()
    assert result.returncode == 0, result.stderr
    assert f"0 to +{memory.FIT_ERROR_PCT}% over the measured peaks" in result.stdout
    gpu_row = next(line for line in result.stdout.splitlines() if line.startswith("gpu "))
    assert "*" in gpu_row  # a 14B teacher is beyond the fitted shapes (a 1.3B-shaped teacher on one GPU)
