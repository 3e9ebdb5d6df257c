"""Fixtures shared by tests/state/'s modules."""

from __future__ import annotations

import pytest

from wandistiller.train import run


@pytest.fixture(scope="session")  # one run, whichever modules read it
def finished(tmp_path_factory, cache_dir, tiny_path):
    """One short real run (a checkpoint at each of 2 steps), copied by each test that alters it."""
    from hydra import compose, initialize_config_dir

    from wandistiller.config import CONF_DIR

    folder = tmp_path_factory.mktemp("finished") / "run"
    overrides = [f"paths.cache_dir={cache_dir}", f"paths.output_dir={folder}", "logger=none", "precision=fp32",
                 "trainer.progress_bar=false", "hooks.samples.prompts=0", "hooks.monitor.val_every=0",
                 "~hooks.evaluate", "trainer.max_steps=2", "trainer.checkpoint_every=1"]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        run(compose("train", overrides=overrides))
    return folder
