"""Shared fixtures: the tiny teachers built once per session in a private cache, and Hydra composition."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from wandistiller.config import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
os.environ.setdefault("WANDB_SILENT", "true")
register_configs()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def tiny_path(cache_dir) -> Path:
    from wandistiller.tiny_teacher import ensure_tiny_teacher

    return ensure_tiny_teacher(cache_dir / "teachers" / "tiny-wan-t2v")


@pytest.fixture(scope="session")
def tiny_moe_path(cache_dir) -> Path:
    from wandistiller.tiny_teacher import ensure_tiny_teacher

    return ensure_tiny_teacher(cache_dir / "teachers" / "tiny-wan-t2v-moe", two_experts=True)


@pytest.fixture
def make_cfg(cache_dir, tmp_path, tiny_path, tiny_moe_path):
    """Compose the real config tree as `python -m wandistiller.train` would, with test-sized defaults."""

    def _make(*overrides: str, run_dir: Path | None = None):
        base = [
            f"paths.cache_dir={cache_dir}",
            f"paths.output_dir={run_dir or tmp_path / 'run'}",
            "logger=none",
            "trainer.progress_bar=false",
            "trainer.sample_prompts=0",
            "precision=fp32",
        ]
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            return compose("train", overrides=base + list(overrides))

    return _make


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m wandistiller.train ARGS` in a fresh process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "wandistiller.train", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        env={**os.environ, **(env or {})},
        timeout=600,
    )
