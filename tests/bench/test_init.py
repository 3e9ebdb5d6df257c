"""Tests wandistiller/bench/__init__.py: where every benchmark writes its JSON by default, and that built teachers
go under WANDISTILLER_CACHE as for training (the module re-read with the variable set and unset)."""

from __future__ import annotations

import importlib

import wandistiller.bench as bench


def test_each_benchmark_writes_under_outputs_bench_by_its_name():
    assert [bench.out_path(n) for n in ("overhead", "job")] == ["outputs/bench/overhead.json", "outputs/bench/job.json"]


def test_the_cache_is_wandistiller_cache_or_the_training_default(monkeypatch, tmp_path):
    try:
        monkeypatch.setenv("WANDISTILLER_CACHE", str(tmp_path))
        assert importlib.reload(bench).CACHE == str(tmp_path)
        monkeypatch.delenv("WANDISTILLER_CACHE")
        assert importlib.reload(bench).CACHE == "~/.cache/wandistiller"
    finally:
        monkeypatch.undo()
        importlib.reload(bench)  # as the session's environment gives it
