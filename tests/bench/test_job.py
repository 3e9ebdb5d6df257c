"""Tests wandistiller/bench/job.py by running `python -m wandistiller.bench job` on the CPU (slow lane): the
framework job and the hand-written loop do the same arithmetic (same seed, same steps, same loss). Not a timing:
benchmarks are run on purpose, not in tests."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from wandistiller.bench import job


@pytest.mark.slow
def test_bench_job_tiny_cpu_framework_and_handwritten_reach_the_same_loss(tmp_path, cache_dir):
    out = tmp_path / "job.json"
    args = ["--arch", "tiny", "--device", "cpu", "--batch", "2", "--steps", "4", "--warmup", "1", "--log-every", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "wandistiller.bench", "job", *args, "--cache-dir", str(cache_dir), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    ours, theirs = result["framework"], result["handwritten"]
    assert set(ours["losses"]) == set(theirs["losses"]) == {"2", "4"}
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6)
    assert ours["samples_per_s"] > 0 and theirs["samples_per_s"] > 0 and result["ratio"] > 0
    assert "ratio" in done.stdout


def job_args(**given) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    job.add_parser(parser.add_subparsers())
    args = parser.parse_args(["job", "--device", "cpu"])
    return argparse.Namespace(**(vars(args) | given))


def test_sizes_default_by_architecture_and_device():
    tiny, real = job_args(arch="tiny"), job_args(arch="14b", device="cuda")
    job._defaults(tiny)
    job._defaults(real)
    assert (tiny.student, tiny.latent_height, tiny.latent_width, tiny.precision) == ("tiny", 8, 8, "fp32")
    assert (real.student, real.latent_height, real.latent_width, real.precision) == ("small", 60, 104, "bf16")
    given = job_args(arch="tiny", student="small", latent_height=4, quantize="fp8")
    job._defaults(given)
    assert (given.student, given.latent_height, given.precision) == ("small", 4, "bf16")  # fp8 computes in bf16


def test_the_train_jobs_overrides_are_the_hand_written_loops_settings(tmp_path):
    args = job_args(arch="tiny", placement="offload", cache_dir=str(tmp_path), steps=6, log_every=2)
    job._defaults(args)
    overrides = job.job_overrides(args, tmp_path / "teacher", tmp_path / "run")
    assert f"teacher.path={tmp_path / 'teacher'}" in overrides and f"hydra.run.dir={tmp_path / 'run'}" in overrides
    assert "teacher_placement=cpu" in overrides  # on the CPU whatever --placement says
    assert {"trainer.max_steps=6", "trainer.log_every=2", "hooks.monitor.val_every=0", "logger=none"} <= set(overrides)
    assert not any(o.startswith(("teacher.compile", "teacher.quantize", "trainer.compile")) for o in overrides)
    args = job_args(arch="1.3b", device="cuda", compile=True, compile_mode="reduce-overhead", quantize="fp8")
    job._defaults(args)
    overrides = job.job_overrides(args, tmp_path, tmp_path / "run")
    assert "teacher_placement=gpu" in overrides and {"teacher.compile=true", "trainer.compile_student=true",
        "trainer.compile_mode=reduce-overhead", "teacher.quantize=fp8"} <= set(overrides)  # fmt: skip
