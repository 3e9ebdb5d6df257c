"""The loop reads its numbers from the device only when it logs: grouped steps equal per-step ones."""

from __future__ import annotations

import json

from wandistiller.train import run

KEYS = {"step", "loss", "loss_velocity", "loss_hidden", "grad_norm", "lr", "samples_per_s", "step_ms"}
KEYS |= {"teacher_ms", "student_ms", "host_peak_rss_gib"}


def steps(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics_steps.jsonl").read_text().splitlines()]


def test_logging_every_few_steps_keeps_every_steps_metrics_and_values(make_cfg, tmp_path):
    common = ["trainer.max_steps=5", "trainer.checkpoint_every=2", "trainer.batch_size=2"]
    run(make_cfg(*common, "trainer.log_every=1", run_dir=tmp_path / "each"))
    run(make_cfg(*common, "trainer.log_every=3", run_dir=tmp_path / "grouped"))
    each, grouped = steps(tmp_path / "each"), steps(tmp_path / "grouped")
    assert [s["step"] for s in grouped] == [1, 2, 3, 4, 5]
    assert all(KEYS <= set(s) for s in grouped)
    assert all(s["step_ms"] > s["teacher_ms"] > 0 and s["samples_per_s"] > 0 for s in grouped)
    for key in ("loss", "loss_velocity", "loss_hidden", "grad_norm", "lr"):
        assert [s[key] for s in grouped] == [s[key] for s in each], key
