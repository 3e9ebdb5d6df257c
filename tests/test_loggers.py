"""Loggers as a list (`logger=[wandb,tensorboard,csv]`): every shipped option composes into its own schema,
each writes its files in the run folder, a sweep's report goes through each, and configs saved with the one
flat logger of before still read back."""

from __future__ import annotations

import csv
import json

import pytest
from conftest import CONF
from hydra.errors import HydraException
from omegaconf import OmegaConf

from wandistiller.core.errors import UserError
from wandistiller.core.renamed import modernize, modernize_loggers
from wandistiller.tracking import loggers
from wandistiller.train import run

OPTIONS = sorted(p.stem for p in (CONF / "logger").glob("*.yaml"))


def test_every_logger_module_has_its_yaml_and_every_yaml_but_none_its_module():
    assert set(loggers.options()) == set(OPTIONS) - {"none"}


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


def test_a_key_of_the_old_flat_logger_names_the_new_place(make_cfg):
    from wandistiller.config import compose_config

    with pytest.raises(UserError, match=r"logger.wandb.mode=online"):
        compose_config(["logger.mode=online"])


def test_a_logger_whose_settings_would_fail_late_is_refused_before_the_run_folder(make_cfg, tmp_path):
    with pytest.raises(UserError, match=r"^logger.csv.file='../x.csv' must be a .csv file name in the run folder"):
        run(make_cfg("logger=csv", "logger.csv.file=../x.csv", run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_a_config_saved_with_the_one_flat_logger_reads_back_as_the_list():
    saved = OmegaConf.create({"logger": {"_target_": "wandistiller.tracking.WandbTracker", "project": "p"}})
    modernize(saved)
    modernize_loggers(saved)
    assert saved.logger.wandb._target_ == "wandistiller.tracking.loggers.wandb.WandbTracker"
    assert saved.logger.wandb.project == "p"
    none = OmegaConf.create({"logger": {"_target_": "wandistiller.tracking.loggers.NullTracker"}})
    modernize_loggers(none)
    assert OmegaConf.to_container(none.logger) == {}
    hostile = OmegaConf.create({"logger": {"_target_": "pathlib.Path.write_text"}})
    modernize_loggers(hostile)
    assert hostile.logger._target_ == "pathlib.Path.write_text"  # left for the allow-list to refuse


def test_a_sweeps_report_goes_through_every_logger(tmp_path, make_cfg):
    from PIL import Image

    png = tmp_path / "sweep_report.png"
    Image.new("RGB", (8, 8)).save(png)
    cfg = make_cfg("logger=[tensorboard,csv]")
    loggers.build(cfg.logger).report(tmp_path, ["point", "status"], [["a=1", "completed"]], png, "sweep-x")
    assert (tmp_path / "sweep_report.csv").read_text().splitlines() == ["point,status", "a=1,completed"]
    assert list((tmp_path / "tensorboard").glob("events.*"))
