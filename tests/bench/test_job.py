"""Tests wandistiller/bench/job.py by running `python -m wandistiller.bench job` on the CPU (slow lane): the
framework job and the hand-written loop do the same arithmetic (same seed, same steps, same loss). Not a timing:
benchmarks are run on purpose, not in tests."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


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
