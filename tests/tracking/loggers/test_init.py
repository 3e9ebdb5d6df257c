"""Tests wandistiller/tracking/loggers/__init__.py, the registry and `Loggers` list (`logger=[wandb,tensorboard,csv]`):
every shipped option composes into its own schema, each writes its files in the run folder, a sweep's report goes
through each, one failing leaves none open, and configs saved with the one flat logger of before still read back."""

from __future__ import annotations

import csv
import json

import pytest
from hydra.errors import HydraException

from tests.conftest import CONF
from tests.tracking.loggers.test_tensorboard import _scalars
from wandistiller.tracking import loggers
from wandistiller.train import run

OPTIONS = sorted(p.stem for p in (CONF / "logger").glob("*.yaml"))


def test_every_logger_module_has_its_yaml_and_every_yaml_but_none_its_module():
    assert set(loggers.REGISTRY.names()) == set(OPTIONS) - {"none"}


@pytest.mark.parametrize("option", OPTIONS)
def test_each_option_composes_into_its_schema_and_logs_into_the_run_folder(make_cfg, tmp_path, option):
    cfg = make_cfg(f"logger={option}")
    assert list(cfg.logger) == ([] if option == "none" else [option])
    if option == "wandb":
        cfg.logger.wandb.mode = "disabled"  # the real wandb run is the whole-run test's
    with pytest.raises(HydraException):  # a key the option does not take fails at composition
        make_cfg(f"logger={option}", f"logger.{option}.no_such_key=1")
    tracker = loggers.build(cfg.logger)
    tracker.start(tmp_path, {"seed": 0}, None)
    tracker.log({"loss": 0.5, "lr": 1e-3}, step=1)
    tracker.log({"loss": 0.25, "val/loss": 0.3}, step=2)
    png = tmp_path / "grid.png"
    from PIL import Image

    Image.new("RGB", (8, 8)).save(png)
    tracker.log_image("samples", png, step=2)
    tracker.finish({"loss_last": 0.25})
    if option == "csv":
        rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
        assert [r["step"] for r in rows] == ["1", "2"] and rows[1]["val/loss"] == "0.3" and rows[0]["val/loss"] == ""
    if option == "tensorboard":
        assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_three_loggers_at_once_each_leave_their_files_and_a_resume_continues_them(make_cfg, tmp_path):
    folder = tmp_path / "run"
    both = ("logger=[wandb,tensorboard,csv]", "trainer.max_steps=2", "trainer.log_every=1")
    summary = run(make_cfg(*both, run_dir=folder))
    assert summary["status"] == "completed"
    assert list((folder / "wandb").glob("offline-run-*")) and list((folder / "tensorboard").glob("events.*"))
    rows = list(csv.DictReader((folder / "metrics.csv").read_text().splitlines()))
    assert [r["step"] for r in rows if r["loss"]] == ["1", "2"]
    state = json.loads(next((folder / "checkpoints").glob("step_*/state.json")).read_text())
    assert state["tracker_run_id"]  # wandb's id, so a resume continues its run
    run(make_cfg(both[0], both[2], "trainer.max_steps=3", "trainer.resume=auto", run_dir=folder))
    rows = list(csv.DictReader((folder / "metrics.csv").read_text().splitlines()))
    assert [r["step"] for r in rows if r["loss"]] == ["1", "2", "3"]  # appended to the same file
    last = json.loads(sorted((folder / "checkpoints").glob("step_*/state.json"))[-1].read_text())
    assert last["tracker_run_id"] == state["tracker_run_id"]  # the same wandb run continued


def test_a_sweeps_report_goes_through_every_logger(tmp_path, make_cfg):
    from PIL import Image

    png = tmp_path / "sweep_report.png"
    Image.new("RGB", (8, 8)).save(png)
    cfg = make_cfg("logger=[tensorboard,csv]")
    loggers.build(cfg.logger).report(tmp_path, ["point", "status"], [["a=1", "completed"]], png, "sweep-x")
    assert (tmp_path / "sweep_report.csv").read_text().splitlines() == ["point,status", "a=1,completed"]
    assert list((tmp_path / "tensorboard").glob("events.*"))


def test_a_resume_drops_what_a_killed_segment_logged_past_its_checkpoint(make_cfg, tmp_path):
    cfg = make_cfg("logger=[tensorboard,csv]")
    first = loggers.build(cfg.logger)
    first.start(tmp_path, {}, None, start_step=0)
    for step in range(1, 8):  # killed after step 7; its last checkpoint was step 5
        first.log({"loss": float(step)}, step=step)
    first.close()
    with (tmp_path / "metrics.csv").open("a") as f:
        f.write("8,0.12")  # a write cut off by the kill
    second = loggers.build(cfg.logger)
    second.start(tmp_path, {}, None, start_step=5)
    second.log({"loss": 60.0}, step=6)
    second.close()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    assert [(r["step"], r["loss"]) for r in rows] == [(str(s), f"{float(s)}") for s in range(1, 6)] + [("6", "60.0")]
    assert _scalars(tmp_path / "tensorboard") == [(s, float(s)) for s in range(1, 6)] + [(6, 60.0)]


CLOSED: list[str] = []


class Recording(loggers.Logger):
    """A logger of the user's own (what logger.<name>._target_ may name): records that it was closed."""

    def close(self) -> None:
        CLOSED.append("closed")


def test_a_run_that_crashes_still_closes_its_loggers_so_tensorboard_writes_what_it_buffered(
    make_cfg, tmp_path, monkeypatch
):
    CLOSED.clear()
    monkeypatch.setenv("WANDISTILLER_INJECT_FAILURE", "0:3")
    cfg = make_cfg("logger=tensorboard", f"+logger.rec._target_={__name__}.Recording", "trainer.max_steps=4",
                   "trainer.log_every=1", run_dir=tmp_path / "r")  # fmt: skip
    with pytest.raises(RuntimeError, match="injected failure at step 3"):
        run(cfg)
    assert CLOSED == ["closed"]
    assert [s for s, _ in _scalars(tmp_path / "r" / "tensorboard")][:2] == [1, 2]


class Failing(loggers.Logger):
    def __init__(self, fail: str):
        self.fail, self.calls = fail, []

    def start(self, *args, **kwargs) -> None:
        self.calls.append("start")
        if self.fail == "start":
            raise OSError("start failed")

    def finish(self, summary) -> None:
        self.calls.append("finish")
        if self.fail == "finish":
            raise OSError("finish failed")

    def close(self) -> None:
        self.calls.append("close")


def test_one_logger_failing_leaves_none_of_the_others_unfinished_or_open(tmp_path):
    first, broken, last = Failing(""), Failing("finish"), Failing("")
    with pytest.raises(OSError, match="finish failed"):
        loggers.Loggers([first, broken, last]).finish({})
    assert last.calls == ["finish"]  # still finished after the one before it raised
    first, broken, last = Failing(""), Failing("start"), Failing("")
    with pytest.raises(OSError, match="start failed"):
        loggers.Loggers([first, broken, last]).start(tmp_path, {}, None)
    assert first.calls == ["start", "close"] and last.calls == []  # the started one closed


class OldShape(loggers.Logger):
    """A user's logger written before start_step: start without it, no close of its own."""

    def start(self, run_dir, config, run_id, group=None, name=None) -> None:
        self.started = run_dir


def test_a_users_logger_of_the_old_shape_still_starts_and_closes(tmp_path):
    old = OldShape()
    both = loggers.Loggers([old, Failing("")])
    both.start(tmp_path, {}, None, start_step=3)
    both.close()
    assert old.started == tmp_path and both.loggers[1].calls == ["start", "close"]


def test_a_logger_module_is_its_option_by_module_name_not_a_class_attribute():
    assert all(o.cls.name in ("", name) for name, o in loggers.REGISTRY.options.items())
    assert "none" not in loggers.REGISTRY.names()
    assert loggers.Logger.name != "none"  # a logger forgetting `name` takes no option's slot
