"""Tests wandistiller/tracking/loggers/wandb.py: its early refusals (a project name wandb refuses, online without a
login, found where wandb looks: the key, .netrc, its settings file) and the offline folders one run leaves, with
real wandb settings and no network."""

from __future__ import annotations

import pytest

from tests.conftest import refused
from tests.job.test_preflight import refused_run
from wandistiller.core.errors import UserError
from wandistiller.tracking.loggers.wandb import WandbTracker, offline_segments
from wandistiller.train import run


@pytest.mark.parametrize("project", ["team/run", "what?", "a" * 129])
def test_a_project_name_wandb_refuses_is_one_line_before_the_run_folder(make_cfg, tmp_path, project):
    error = refused_run(make_cfg, tmp_path, "logger=wandb", f"logger.wandb.project='{project}'")
    assert error.startswith(f"logger.wandb.project={project!r}: a wandb project name may not contain"), error
    assert "use e.g. logger.wandb.project=wandistiller" in error


def test_online_wandb_without_a_login_is_refused_before_the_run_folder(make_cfg, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    with refused("logger.wandb.mode=online: no wandb login for https://api.wandb.ai") as e:
        run(make_cfg("logger=wandb", "logger.wandb.mode=online", run_dir=tmp_path / "r"))
    assert "wandb login" in str(e.value) and not (tmp_path / "r").exists()
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "a" * 40 + "\n")
    (tmp_path / "netrc").chmod(0o600)
    assert WandbTracker.login_problem("online") is None
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_API_KEY", "b" * 40)
    assert WandbTracker.login_problem("online") is None and WandbTracker.login_problem("offline") is None


@pytest.fixture
def no_login(tmp_path, monkeypatch):
    """No wandb key anywhere wandb looks: the environment, a .netrc, its settings file."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    return tmp_path


def test_an_api_key_in_wandbs_settings_file_is_a_login_and_other_sections_keys_are_not(no_login):
    settings = no_login / "wandb-config" / "settings"
    settings.parent.mkdir()
    settings.write_text("[default]\nentity = me\n")
    no_key = "no wandb login for https://api.wandb.ai (no WANDB_API_KEY, no .netrc entry)"
    assert WandbTracker.login_problem("online") == no_key
    settings.write_text("[default]\napi_key = " + "c" * 40 + "\n")
    assert WandbTracker.login_problem("online") is None
    settings.write_text("not an ini file [")  # unreadable: no key, and no crash
    assert WandbTracker.login_problem("online").startswith("no wandb login")


def test_a_login_is_looked_for_at_the_host_wandb_base_url_names(no_login, monkeypatch):
    (no_login / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "a" * 40 + "\n")
    (no_login / "netrc").chmod(0o600)
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    assert WandbTracker.login_problem("online") == (
        "no wandb login for https://wandb.example.com (no WANDB_API_KEY, no .netrc entry)"
    )
    assert WandbTracker.login_problem("disabled") is None  # only online needs a login


def test_the_check_names_the_key_it_was_given_and_passes_a_good_project(no_login):
    node = {"project": "wandistiller", "mode": "offline"}
    assert WandbTracker.project_problem("wandistiller") is None and WandbTracker.project_problem(None) is None
    WandbTracker.check(node, "logger.mine")
    with pytest.raises(UserError, match=r"^logger.mine.mode=online: no wandb login .*use logger.mine.mode=offline$"):
        WandbTracker.check(node | {"mode": "online"}, "logger.mine")


def test_a_wandb_mode_in_the_environment_that_wandb_refuses_is_one_line_before_the_teacher(monkeypatch):
    # An audit's: WANDB_MODE=garbage was an internal error at wandb.init, once the teacher had loaded.
    node = {"project": "wandistiller", "mode": "offline"}
    monkeypatch.setenv("WANDB_MODE", "garbage")
    with pytest.raises(UserError, match=r"^logger.wandb: the environment's WANDB_MODE='garbage' is not a wandb mode"):
        WandbTracker.check(node, "logger.wandb")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    WandbTracker.check(node, "logger.wandb")


def test_offline_segments_are_every_folder_of_that_run_id_oldest_first(tmp_path):
    names = ["offline-run-20261126_101500-abc", "offline-run-20261126_101500-abc-1", "offline-run-20261126_090000-abc",
             "offline-run-20261126_091000-abcd", "offline-run-20261126_092000-xyz",
             "run-20261126_093000-abc"]  # fmt: skip
    for name in names:
        (tmp_path / name).mkdir()
    assert [p.name for p in offline_segments(tmp_path, "abc")] == [
        "offline-run-20261126_090000-abc", "offline-run-20261126_101500-abc", "offline-run-20261126_101500-abc-1"
    ]  # fmt: skip
    assert offline_segments(tmp_path, "nothing") == []


def test_evals_offline_wandb_hand_off_never_writes_through_a_linked_wandb_folder(tmp_path):
    from tests.core.test_files import victim

    mine = victim(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "wandb").symlink_to(mine.parent)
    with pytest.raises(UserError, match="wandb leads out of the run folder"):
        WandbTracker(project="p", mode="offline").start(tmp_path / "run", {}, "abc123")
    assert sorted(p.name for p in mine.parent.iterdir()) == ["victim.txt"]
