"""Tests wandistiller/tracking/loggers/csv.py: its file-name refusal, one row per step (a validation joins its
step's row, a new key widens the header), and what a resumed or later process keeps of the file (a killed write's
torn line dropped); real files in tmp_path, driven directly and through `train.run`."""

from __future__ import annotations

import csv

import pytest
from omegaconf import OmegaConf

from wandistiller.core.errors import UserError
from wandistiller.tracking import loggers
from wandistiller.tracking.loggers.csv import CsvLogger, read_csv
from wandistiller.train import run


def test_a_logger_whose_settings_would_fail_late_is_refused_before_the_run_folder(make_cfg, tmp_path):
    with pytest.raises(UserError, match=r"^logger.csv.file='../x.csv' must be a .csv file name in the run folder"):
        run(make_cfg("logger=csv", "logger.csv.file=../x.csv", run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_a_validation_at_a_logged_step_joins_its_row(tmp_path):
    tracker = loggers.build(OmegaConf.create({"csv": {"_target_": "wandistiller.tracking.loggers.csv.CsvLogger"}}))
    tracker.start(tmp_path, {}, None)
    tracker.log({"loss": 1.0}, step=1)
    tracker.log({"loss": 0.5}, step=2)
    tracker.log({"val/loss": 0.7}, step=2)  # a new column: the file rewritten
    tracker.log({"loss": 0.25}, step=3)
    tracker.log({"val/loss": 0.6}, step=3)  # an appended line replaced
    rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    assert [(r["step"], r["loss"], r["val/loss"]) for r in rows] == [("1", "1.0", ""), ("2", "0.5", "0.7"),
                                                                     ("3", "0.25", "0.6")]  # fmt: skip


def test_a_run_with_validation_writes_one_csv_row_per_step(make_cfg, tmp_path):
    cfg = make_cfg("logger=csv", "trainer.max_steps=2", "trainer.log_every=1", "hooks.monitor.val_every=1",
                   run_dir=tmp_path / "r")  # fmt: skip
    run(cfg)
    rows = list(csv.DictReader((tmp_path / "r" / "metrics.csv").read_text().splitlines()))
    assert [r["step"] for r in rows] == ["1", "2"] and all(r["loss"] and r["val/loss"] for r in rows)


@pytest.mark.parametrize("name", ["/tmp/m.csv", "logs/m.csv", "metrics.txt", "metrics"])
def test_a_file_that_is_not_a_csv_name_in_the_run_folder_is_refused_naming_the_key(name):
    with pytest.raises(UserError, match=rf"^logger.c.file='{name}' must be a .csv file name in the run folder"):
        CsvLogger.check({"file": name}, "logger.c")
    CsvLogger.check({"file": "losses.csv"}, "logger.c")


def test_a_later_process_keeps_every_row_and_drops_only_a_torn_last_line(tmp_path):
    (tmp_path / "m.csv").write_text("step,loss\n1,0.5\n,0.4\n2,0.3\n3,0.")  # a row without a step; a torn write
    assert read_csv(tmp_path / "m.csv") == (["step", "loss"], [{"step": "1", "loss": "0.5"},
                                            {"step": "", "loss": "0.4"}, {"step": "2", "loss": "0.3"}])  # fmt: skip
    logger = CsvLogger(file="m.csv")
    logger.start(tmp_path, {}, None, start_step=None)  # e.g. an evaluation adding to a finished run
    logger.log({"eval/score": 0.9, "note": "text is not a number"}, step=None)
    rows = list(csv.DictReader((tmp_path / "m.csv").read_text().splitlines()))
    assert [(r["step"], r["loss"], r["eval/score"]) for r in rows] == [("1", "0.5", ""), ("", "0.4", ""),
                                                                       ("2", "0.3", ""), ("", "", "0.9")]  # fmt: skip
    assert "note" not in rows[0]
    assert read_csv(tmp_path / "none.csv") == ([], [])


def test_a_received_runs_metrics_csv_linked_out_of_it_is_refused_and_never_appended_to(tmp_path):
    from tests.core.test_files import untouched, victim

    mine = victim(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.csv").symlink_to(mine)
    with pytest.raises(UserError, match="metrics.csv leads out of the run folder"):
        CsvLogger().start(tmp_path / "run", {}, None, start_step=0)
    (tmp_path / "run" / "metrics.csv").unlink()
    (tmp_path / "run" / "metrics.csv").hardlink_to(mine)
    with pytest.raises(UserError, match="metrics.csv is a hard link"):
        CsvLogger().start(tmp_path / "run", {}, None, start_step=0)
    assert untouched(mine)
