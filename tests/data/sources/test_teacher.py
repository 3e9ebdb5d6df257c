"""wandistiller/data/sources/teacher.py: its latents bring a student closer to its teacher (slow, a script)."""

from __future__ import annotations

import importlib.util
import statistics

import pytest
import torch

from tests.conftest import ROOT
from wandistiller.train import run


@pytest.mark.slow
def test_teacher_latents_give_a_lower_eval_latent_mse_than_gaussian_x0(cache_dir):
    spec = importlib.util.spec_from_file_location("compare_data_sources", ROOT / "scripts/compare_data_sources.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny models run fastest on one thread; several only contend
    try:
        results = [script.compare(cache_dir, steps=1000, seed=seed) for seed in (0, 1, 2)]
    finally:
        torch.set_num_threads(threads)
    gaussian = statistics.fmean(r["gaussian"]["eval_latent_mse"] for r in results)
    latents = statistics.fmean(r["teacher_latents"]["eval_latent_mse"] for r in results)
    # Measured 0.95 (seeds 0, 1, 2: 0.98, 0.92, 0.94; docs/data_sources.md). The random tiny teacher's
    # samples are nearly Gaussian in their statistics, so the gap is small here; it is still every seed's.
    assert latents < 0.97 * gaussian, results
    assert all(r["ratio"] < 1.0 for r in results), results


def test_a_student_trains_on_the_teachers_own_latents(make_cfg, tmp_path, cache_dir):
    overrides = ["data=teacher_latents", "data.sample_steps=2", "trainer.max_steps=2"]
    summary = run(make_cfg(*overrides, run_dir=tmp_path / "a"))
    assert summary["steps_run"] == 2
    made = sorted((cache_dir / "teacher_latents").iterdir())
    run(make_cfg(*overrides, run_dir=tmp_path / "b"))  # a second run reuses the cache
    assert sorted((cache_dir / "teacher_latents").iterdir()) == made
