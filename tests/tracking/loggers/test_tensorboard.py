"""Tests wandistiller/tracking/loggers/tensorboard.py: its refusals of a folder outside the run folder, and that an
event logged reaches the disk within FLUSH_SECS without a close (a killed run loses at most that); real
SummaryWriter, events read back with TensorBoard's own reader."""

from __future__ import annotations

import time

import pytest

from wandistiller.core.errors import UserError
from wandistiller.tracking.loggers import tensorboard


def _scalars(folder, key="loss"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(key)] if key in events.Tags()["scalars"] else []


def test_an_event_is_on_disk_within_the_flush_period_without_a_close(tmp_path, monkeypatch):
    monkeypatch.setattr(tensorboard, "FLUSH_SECS", 0.2)
    logger = tensorboard.TensorboardLogger()
    logger.start(tmp_path, {}, None)
    try:
        assert logger.writer.flush_secs == 0.2  # the writer flushes on the module's period, not TensorBoard's 120 s
        for step in (1, 2):  # TensorBoard writes the first record at once: the second one waits for the period
            logger.log({"loss": 1.0 / step}, step=step)
            deadline = time.monotonic() + 10  # far past the period: a loaded machine may be slow, never 120 s slow
            while len(_scalars(tmp_path / "tensorboard")) < step and time.monotonic() < deadline:
                time.sleep(0.02)
        assert _scalars(tmp_path / "tensorboard") == [(1, 1.0), (2, 0.5)]
    finally:
        logger.close()
    assert logger.writer is None
    logger.close()  # twice is fine: however the run ended, close is called again


# An audit's: the run root, student/ and pipeline/ (the folders that get uploaded) took event files
@pytest.mark.parametrize("folder", ["/tmp/tb", "../tb", "logs/../../tb", "", ".", "student", "pipeline/tb", ".hydra"])
def test_a_folder_outside_the_run_folder_or_another_writers_is_refused_naming_the_key(folder):
    with pytest.raises(UserError, match=rf"^logger.tb.folder='{folder}' must be a folder of its own inside the run"):
        tensorboard.TensorboardLogger.check({"folder": folder}, "logger.tb")
    tensorboard.TensorboardLogger.check({"folder": "logs/tb"}, "logger.tb")  # a subfolder is fine


def test_a_received_runs_tensorboard_folder_linked_out_of_it_is_refused(tmp_path):
    from tests.core.test_files import victim

    mine = victim(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tensorboard").symlink_to(mine.parent)
    with pytest.raises(UserError, match="tensorboard leads out of the run folder"):
        tensorboard.TensorboardLogger().start(tmp_path / "run", {}, None, start_step=0)
    assert sorted(p.name for p in mine.parent.iterdir()) == ["victim.txt"]
