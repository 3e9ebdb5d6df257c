"""Tests wandistiller/bench/overhead.py: both loops it compares train the same tiny student on the tiny teacher,
and the result is their ratio with a printed table; one step each, on the session's tiny teacher."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from wandistiller.bench.overhead import overhead


@pytest.mark.slow  # a bench run: the tiny teacher and every default prompt encoded first (~4 s), then both loops
def test_one_repetition_times_both_loops_and_reports_their_ratio(cache_dir, tiny_path, capsys):
    result = overhead(SimpleNamespace(cache_dir=str(cache_dir), batch_size=1, steps=1, reps=1))
    assert result["benchmark"] == "overhead" and (result["steps"], result["reps"], result["batch_size"]) == (1, 1, 1)
    ours, theirs = result["framework_ms_per_step"], result["handwritten_ms_per_step"]
    assert ours > 0 and theirs > 0 and result["ratio"] == ours / theirs
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"ratio {result['ratio']:.3f}x (target <= 1.10x)"
    assert out[-3].split()[0] == "wandistiller" and out[-2].startswith("hand-written")
