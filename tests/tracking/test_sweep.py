"""Tests wandistiller/tracking/sweep.py, its report read from points' folders and through the CLI. Sweeps: Hydra
multirun points in fresh processes, their report, presets and the Slurm launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from tests.conftest import CONF, ROOT, run_cli
from wandistiller.tracking.sweep import load_points, markdown_table, write_report


@pytest.mark.slow  # a whole multirun in fresh processes
def test_a_two_point_sweep_reports_both_points_and_records_the_refused_one(tmp_path, cache_dir, tiny_path):
    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m",
        "teacher_placement=cpu,gpu0",
        "trainer.max_steps=3",
        f"hydra.sweep.dir={sweep}",
        f"paths.cache_dir={cache_dir}",
        "hooks.samples.prompts=0",
        "~hooks.evaluate",
        "hooks.monitor.val_every=0",
        "trainer.progress_bar=false",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    done, refused = (json.loads((sweep / str(i) / "metrics.json").read_text()) for i in (0, 1))
    assert done["status"] == "completed" and done["samples_per_s_median"] > 0 and done["step_ms_median"] > 0
    assert done["overrides"] and done["teacher_ms_median"] > 0 and done["host_peak_rss_gib_max"] > 0
    assert refused["status"] == "refused" and "teacher_placement=gpu0" in refused["reason"]
    report = (sweep / "sweep_report.md").read_text()
    assert "teacher_placement=cpu | completed" in report and "teacher_placement=gpu0 | refused" in report
    assert (sweep / "sweep_report.png").stat().st_size > 10_000
    assert "sweep report:" in result.stdout and "| teacher_placement=cpu | completed |" in result.stdout
    # One wandb run per point that trained, plus the report's run; offline, with the sync command printed.
    assert list((sweep / "0" / "wandb").glob("offline-run-*")) and list((sweep / "wandb").glob("offline-run-*"))
    assert "wandb sync" in result.stdout

    compared = subprocess.run(
        [sys.executable, "scripts/compare_sweeps.py", str(sweep), str(sweep)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert compared.returncode == 0 and "| teacher_placement=cpu | " in compared.stdout and "1.00x" in compared.stdout


@pytest.mark.parametrize(
    "statuses,said",
    [
        (["completed", "refused"], None),  # gpu0 refused on a one-GPU machine: a finding, not a failed sweep
        (["refused", "refused"], "error: no point trained (each refused); the report above says why (exit code 1)"),
        (["completed", "failed"], "error: 1 point(s) failed: seed=1; the report above says why"),
    ],
)
def test_the_sweeps_exit_code_fails_on_a_crashed_point_or_when_none_trained(
    tmp_path, capsys, monkeypatch, statuses, said
):
    from omegaconf import OmegaConf

    from wandistiller.tracking import sweep
    from wandistiller.tracking.sweep import SweepReport

    for i, status in enumerate(statuses):
        (tmp_path / str(i) / ".hydra").mkdir(parents=True)
        (tmp_path / str(i) / ".hydra" / "overrides.yaml").write_text(f"- seed={i}\n")
        (tmp_path / str(i) / "metrics.json").write_text(json.dumps({"status": status, "reason": "r"}))
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    monkeypatch.setattr(sweep, "FAILED_SWEEP", [])
    SweepReport(loggers=False).on_multirun_end(config)  # the CLI exits 1 after every callback ran (train.cli)
    assert sweep.FAILED_SWEEP == ([] if said is None else [str(tmp_path)])
    err = capsys.readouterr().err
    assert err.strip().startswith(said) if said else err == ""


@pytest.mark.slow  # a multirun in a fresh process
def test_a_sweep_whose_every_point_is_refused_exits_1_after_its_report(tmp_path, cache_dir):
    sweep = tmp_path / "sweep"
    result = run_cli("-m", "trainer.max_steps=-2,-1", f"hydra.sweep.dir={sweep}", f"paths.cache_dir={cache_dir}")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "| trainer.max_steps=-2 | refused |" in result.stdout and (sweep / "sweep_report.md").is_file()
    assert result.stderr.strip().endswith(
        "error: no point trained (each refused); the report above says why (exit code 1)"
    )


def test_a_point_that_died_without_metrics_is_reported_as_failed(tmp_path):
    for i, placement in enumerate(["cpu", "gpu"]):
        (tmp_path / str(i) / ".hydra").mkdir(parents=True)
        (tmp_path / str(i) / ".hydra" / "overrides.yaml").write_text(f"- teacher_placement={placement}\n- seed=1\n")
    (tmp_path / "0" / "metrics.json").write_text(json.dumps({"status": "completed", "samples_per_s_median": 5.0}))
    points = load_points(tmp_path)
    assert [p.label for p in points] == ["teacher_placement=cpu", "teacher_placement=gpu"]  # only what varies
    assert "| teacher_placement=gpu | failed |" in markdown_table(points)
    old = os.umask(0o022)
    try:
        md, png, _ = write_report(tmp_path)
    finally:
        os.umask(old)
    assert md.is_file() and png.stat().st_size > 0
    assert md.stat().st_mode & 0o777 == 0o644  # written whole, and as readable as open() made it


def test_points_under_a_named_subdir_are_read_too(tmp_path):
    # An audit's: hydra.sweep.subdir=${hydra.job.override_dirname} trained both points, and the report read none
    for name in ("precision=fp32", "precision=bf16"):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / ".hydra" / "overrides.yaml").write_text(f"- {name}\n")
        (tmp_path / name / "metrics.json").write_text(json.dumps({"status": "completed"}))
    (tmp_path / "wandb").mkdir()  # the sweep's own report run: no point
    assert [p.label for p in load_points(tmp_path)] == ["precision=bf16", "precision=fp32"]


def test_a_killed_point_is_read_from_its_metrics_csv(tmp_path):
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "metrics.csv").write_text("step,loss,val/loss\n1,0.5,\n2,0.4,0.45\n3,0.3,\n")
    [point] = load_points(tmp_path)
    assert point.metrics["status"] == "failed" and point.metrics["final_step"] == 3
    assert point.metrics["val_loss_last"] == 0.45 and "after step 3" in point.metrics["reason"]
    assert "0.45000" in markdown_table([point])


def test_the_report_callback_takes_loggers_and_its_old_name_wandb():
    from wandistiller.tracking.sweep import SweepReport

    assert SweepReport().loggers and not SweepReport(loggers=False).loggers and not SweepReport(wandb=False).loggers


def hydra_cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("train", overrides=list(overrides), return_hydra_config=True)


def test_the_placement_sweep_preset_composes():
    cfg = hydra_cfg("experiment=placement_sweep")  # as the CLI hands it to Hydra (core.hydra.experiment_in_place)
    assert cfg.hydra.sweeper.params.teacher_placement == "cpu,gpu" and cfg.trainer.max_steps == 30
    assert cfg.hooks.monitor.val_every == 0  # not 50 > 30 steps, which warned "no validation will run" at every point
    assert cfg.hydra.callbacks.sweep_report._target_ == "wandistiller.tracking.sweep.SweepReport"


def test_the_slurm_launcher_composes():
    cfg = hydra_cfg("hydra/launcher=slurm", "distributed.nproc_per_node=8")
    assert "submitit" in cfg.hydra.launcher._target_.lower() and cfg.hydra.launcher.gpus_per_node == 8
