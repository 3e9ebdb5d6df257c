"""Tests wandistiller/tracking/loggers/base.py: the do-nothing Logger every logger extends and the helpers `Loggers`
runs a list through (the first run id, which `start` takes `start_step`, every logger called even after one
raised), with small loggers of the user's own shape."""

from __future__ import annotations

import logging

import pytest

from wandistiller.tracking.loggers.base import Logger, Loggers, _each, _takes


def test_the_base_logger_takes_any_keys_and_every_call_does_nothing(tmp_path):
    logger = Logger(project="p", anything=1)
    logger.check({"x": 1}, "logger.mine")
    logger.start(tmp_path, {}, None, start_step=3)
    logger.log({"loss": 1.0}, 1)
    logger.log_image("grid", tmp_path / "grid.png", 1)
    logger.report(tmp_path, ["a"], [["1"]], tmp_path / "r.png", "g")
    logger.finish({})
    logger.close()
    assert logger.run_id is None and list(tmp_path.iterdir()) == []


class WithId(Logger):
    def __init__(self, run_id: str | None, calls: list[str]):
        self.run_id, self.calls = run_id, calls

    def log(self, metrics, step) -> None:
        self.calls.append(f"{self.run_id}:{step}")


def test_loggers_call_each_in_the_config_order_and_continue_the_first_run_id():
    calls: list[str] = []
    both = Loggers([WithId(None, calls), WithId("abc", calls), WithId("xyz", calls)])
    both.log({"loss": 1.0}, 7)
    assert calls == ["None:7", "abc:7", "xyz:7"] and both.run_id == "abc"
    assert Loggers([WithId(None, calls)]).run_id is None and Loggers([]).run_id is None


def test_start_step_is_given_only_to_a_start_that_takes_it():
    def old(run_dir, config, run_id, group=None, name=None): ...
    def new(run_dir, config, run_id, group=None, name=None, start_step=None): ...
    def any_keys(run_dir, config, run_id, **kwargs): ...

    assert [_takes(f, "start_step") for f in (old, new, any_keys)] == [False, True, True]


def test_every_logger_is_called_then_the_first_error_is_raised_and_the_others_logged(caplog):
    called: list[int] = []

    def call(n: int) -> None:
        called.append(n)
        if n in (2, 3):
            raise ValueError(f"logger {n} failed")

    with caplog.at_level(logging.ERROR), pytest.raises(ValueError, match="^logger 2 failed$"):
        _each([1, 2, 3, 4], call)
    assert called == [1, 2, 3, 4]
    assert "logger int also failed: ValueError: logger 3 failed" in caplog.text
