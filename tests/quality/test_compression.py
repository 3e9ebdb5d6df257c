"""`wandistiller.quality.compression`: its rows, targets, table and plot from known numbers; the command (slow)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from wandistiller.quality.__main__ import compression_report, table
from wandistiller.quality.compare import Settings
from wandistiller.quality.compression import BUDGETS, COLUMNS, Row, plot, rows, targets


def results(accuracy: dict[str, float], teacher: float = 0.9) -> dict[str, list[dict]]:
    """{teacher, every row}: one seed, accuracy by row name (0.1 where not given), FID 100 for all."""
    one = lambda a, share: {"prompt_accuracy": a, "fid": 100.0, "kid": 1.0, "latent_mse": 0.1,
                            "params": share, "s_per_image": 0.01, "train_s": 60.0}  # fmt: skip
    shares = {"half": 0.57, "quarter": 0.21, "tenth": 0.1}
    return {"teacher": [one(teacher, 1.0)]} | {r.name: [one(accuracy.get(r.name, 0.1), shares[r.size])] for r in rows()}


def test_rows_are_every_size_started_pruned_and_random_with_output_and_several_layer_kd():
    names = [r.name for r in rows()]
    assert len(names) == 12 and names[0] == "half, pruned, output KD" and names[-1] == "tenth, random, several-layer KD"
    assert Row("quarter", "random", "several-layer KD").overrides() == [
        "student.init=random", "loss=features", "data=pocket_digits"]  # fmt: skip
    assert set(BUDGETS) == {"half", "quarter", "tenth"}


@pytest.mark.slow  # twelve compositions of the config tree
def test_every_row_composes_with_the_student_start_and_loss_its_name_says(make_cfg):
    for row in rows():
        cfg = make_cfg("teacher=pocket", f"student={row.size}", *row.overrides())
        assert cfg.student.builder == row.size and cfg.student.init == row.init.replace("pruned", "teacher")
        assert cfg.trainer.loss._target_.rsplit(".", 1)[-1] == (
            "Distillation" if row.loss == "output KD" else "Features"
        )


def test_the_targets_are_met_when_the_pruned_students_keep_the_teachers_accuracy_and_beat_random():
    good = results({"quarter, pruned, output KD": 0.8, "quarter, pruned, several-layer KD": 0.85,
                    "tenth, pruned, output KD": 0.6, "tenth, pruned, several-layer KD": 0.58})  # fmt: skip
    lines = targets(good)
    assert all("MISSED" not in line for line in lines), lines
    assert "quarter (best: quarter, pruned, several-layer KD): 94% of the teacher's accuracy" in lines[0]
    assert lines[-1] == "- tenth, pruned: several-layer KD 58.0% vs output KD 60.0%: output KD as good or better"
    bad = targets(results({"quarter, pruned, output KD": 0.5, "tenth, pruned, output KD": 0.3}))
    # quarter (56%), tenth (33%), and pruned over random by < 30 points everywhere but quarter's output KD (40).
    assert (
        sum("MISSED" in line for line in bad) == 5 and "quarter, output KD: pruned start beats random by 40.0" in bad[2]
    )


def test_the_report_shows_params_as_a_share_and_links_the_plot(tmp_path):
    numbers = results({"quarter, pruned, output KD": 0.8})
    text = compression_report(numbers, Settings(seeds=(0,)), BUDGETS, ["--compression"], 600, jobs=2)
    assert "`python -m wandistiller.quality --compression`" in text and "2 run(s) at once" in text
    assert "steps per size: half 1000, quarter 4000, tenth 4000" in text
    assert table(numbers, COLUMNS, {"params": "share"}) in text and "| teacher | 100.0% | 90.0% |" in text
    assert "](compression.png)" in text
    plot(numbers, tmp_path / "compression.png")
    assert (tmp_path / "compression.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_compression_command_runs_small(tmp_path, cache_dir):
    out = tmp_path / "QUALITY.md"
    result = subprocess.run([sys.executable, "-m", "wandistiller.quality", "--compression", "--small", "--jobs", "2",
                             "--out", str(out)], capture_output=True, text=True, timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    text = out.read_text()
    assert "<!-- quality:compression -->" in text and "| tenth, random, several-layer KD |" in text
    assert (tmp_path / "compression.png").is_file()
