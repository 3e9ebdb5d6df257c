"""`wandistiller.core.plugins`: a package outside WanDistiller (tests/core/dummyplugin/) adds a method, a teacher
placement, a loss and a logger, each one module + one YAML and no other edit, and every part of the project that
lists, composes, plans, refuses or runs options sees them (`WANDISTILLER_PLUGINS=dummyplugin`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from tests.conftest import cli, metrics_steps, refused, workload
from wandistiller import plan
from wandistiller.compose import register_configs, registries
from wandistiller.core.errors import UserError
from wandistiller.core.hydra import compose_config
from wandistiller.core.plugins import ENV, conf_options, plugin_modules
from wandistiller.job.checks import built_quietly, check_tracker
from wandistiller.state import received

HERE = Path(__file__).parent
KINDS = ("method", "teacher_placement", "loss", "logger")  # the groups dummyplugin adds an option to


def forget_options() -> None:
    """Every registry (and what is derived from them) reads its options again on next use."""
    for registry in registries():
        registry.__dict__.pop("options", None)
    received._shipped_targets.cache_clear()


@pytest.fixture
def plugin(monkeypatch):
    """dummyplugin on the path and named by WANDISTILLER_PLUGINS; afterwards every trace of it is gone (the
    registries, the modules, the ConfigStore), so other tests see the shipped options alone."""
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv(ENV, "dummyplugin")
    forget_options()
    register_configs()
    yield
    monkeypatch.delenv(ENV)
    forget_options()
    for name in [m for m in sys.modules if m == "dummyplugin" or m.startswith("dummyplugin.")]:
        del sys.modules[name]
    repo = ConfigStore.instance().repo
    for group in KINDS:
        repo.get(group, {}).pop("dummy.yaml", None)
        repo.get("schema", {}).get(group, {}).pop("dummy.yaml", None)


def test_each_registry_lists_the_plugins_option_beside_its_own(plugin):
    by_group = {registry.group: registry for registry in registries()}
    for group in KINDS:
        assert by_group[group].names()[-1] == "dummy"
        assert by_group[group].get("dummy").cls.__module__ == f"dummyplugin.{group}.dummy"
        assert "dummy" in conf_options(group)
    assert "dummy" not in by_group["data"].names() and plugin_modules("data") == []


def test_hydra_composes_each_plugin_option_from_its_yaml_and_schema(plugin):
    cfg = compose_config(["method=dummy", "teacher_placement=dummy", "loss=dummy", "logger=[dummy]"])
    assert (cfg.method.name, cfg.method.weight, cfg.method.steps) == ("dummy", 0.5, None)  # the YAML's, the schema's
    assert cfg.teacher_placement._target_ == "dummyplugin.teacher_placement.dummy.DummyPlacement"
    assert (cfg.trainer.loss._target_, cfg.trainer.loss.scale) == ("dummyplugin.loss.dummy.DummyLoss", 2.0)
    assert dict(cfg.logger.dummy) == {"_target_": "dummyplugin.logger.dummy.DummyLogger", "file": "dummy.txt"}
    assert compose_config(["method=dummy", "method.weight=0.25"]).method.weight == 0.25


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["method=dumy"], "Available options in 'method': dmd dummy kd trajectory"),
        (["logger=[dumy]"], "Available options in 'logger': csv dummy none tensorboard wandb"),
        (["method=dummy", "method.wieght=1"], "Key 'wieght' not in 'DummyConfig'"),
        (["loss=dummy", "trainer.loss.hidden_kd_weight=1"], "Key 'hidden_kd_weight' not in 'DummyLossConfig'"),
    ],
)
def test_a_mistake_in_a_plugin_option_is_one_line_naming_it(plugin, overrides, line):
    with refused(line):
        compose_config(overrides)


def test_the_plugins_own_refusal_is_one_line_before_the_run(plugin):
    with refused("method.weight=-1.0 must be positive; e.g. method.weight=0.5"):
        built_quietly(compose_config(["method=dummy", "method.weight=-1"]).method)


def test_a_plugin_methods_own_network_is_planned_from_its_declaration_alone(plugin):
    """The dummy method declares a student-shaped `shadow` it trains (one update per step) in its `passes`: the
    planner counts its weights and optimizer states in every phase of the step, a phase for its update, and its
    passes in the step time, with no edit to placements/."""
    from wandistiller.placements import memory
    from wandistiller.placements.planner import method_lines

    hardware = ["hardware.gpus=0", "hardware.host_memory_gib=64"]
    (dummy, hw), (kd, _) = (workload(compose_config([*hardware, f"method={m}"])) for m in ("dummy", "kd"))
    (shadow,) = dummy.networks
    assert (shadow.name, shadow.shape, kd.networks) == ("shadow", memory.STUDENT_SHAPED, ())
    states = memory.param_count(dummy.student_config) * 12  # fp32 weights + AdamW's two moments
    assert memory.method_state_bytes(dummy) == states
    assert memory.training_bytes(dummy, "cpu") >= memory.training_bytes(kd, "cpu") + states
    passes = built_quietly(compose_config(["method=dummy"]).method).passes(1, False)
    assert method_lines(dummy, passes)[0].startswith("shadow (method=dummy: student-shaped, ")


def test_a_logger_entry_that_is_no_logger_lists_the_plugins_too(plugin):
    cfg = compose_config(["logger=[dummy]", "+logger.extra=1"])
    with refused("`logger` names loggers (csv, dummy, none, tensorboard, wandb)"):
        check_tracker(cfg)


@pytest.mark.slow  # the plan's first call takes seconds
def test_the_plan_rows_the_plugins_placement_and_a_saved_config_may_name_its_targets(plugin, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["plan", "hardware.gpus=0", "hardware.host_memory_gib=64", "method=dummy"])
    plan.main()
    out = capsys.readouterr().out
    assert "a step of method=dummy" in out and "1 shadow forward + backward, 0 without grad" in out
    assert "shadow (method=dummy: student-shaped, " in out  # the network it declares, counted with no other edit
    assert any(line.split()[:2] == ["dummy", "yes"] for line in out.splitlines()), out
    assert {"dummyplugin.method.dummy.Dummy", "dummyplugin.logger.dummy.DummyLogger"} <= received.allowed_targets()


def test_a_plugin_that_is_not_importable_or_takes_a_shipped_name_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, "no_such_plugin_package")
    with refused("WANDISTILLER_PLUGINS names 'no_such_plugin_package', which cannot be imported as a package"):
        conf_options("method")
    (tmp_path / "clash" / "method").mkdir(parents=True)
    (tmp_path / "clash" / "__init__.py").write_text("")
    (tmp_path / "clash" / "method" / "kd.yaml").write_text("steps: null\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(ENV, "clash")
    with refused("is the option method=kd, which WanDistiller already ships; rename it"):
        register_configs()


@pytest.mark.slow
def test_a_run_trains_with_the_plugins_method_placement_loss_and_logger(tmp_path, cache_dir, tiny_path):
    """As a user runs it: a fresh `python -m wandistiller.train`, the plugin named in the environment."""
    import os
    import subprocess

    run_dir = tmp_path / "run"
    settings = [f"paths.cache_dir={cache_dir}", f"paths.output_dir={run_dir}", "precision=fp32", "hooks=[monitor]"]
    settings += [
        "hooks.monitor.val_every=0",
        "trainer.progress_bar=false",
        "trainer.max_steps=2",
        "trainer.log_every=1",
    ]
    argv = cli(*settings, "method=dummy", "teacher_placement=dummy", "loss=dummy", "logger=[dummy]")
    env = os.environ | {ENV: "dummyplugin", "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    job = subprocess.run([*argv, "--cfg", "job"], capture_output=True, text=True, env=env, timeout=600)
    assert job.returncode == 0 and "_target_: dummyplugin.method.dummy.Dummy" in job.stdout, job.stderr[-3000:]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, cwd=HERE.parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    steps = metrics_steps(run_dir)
    assert [r["step"] for r in steps] == [1, 2] and all(r["dummy_weight"] == 0.5 for r in steps)  # the method's
    assert all(r["loss_shadow"] >= 0 for r in steps)  # its own network's update, logged beside the student's
    assert all(r["loss"] == pytest.approx(2 * r["loss_velocity"]) for r in steps)  # the loss's, scale 2 (its YAML)
    lines = (run_dir / "dummy.txt").read_text().splitlines()
    assert [int(line.split()[0]) for line in lines] == [1, 2]
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["status"] == "completed"


def test_a_saved_config_naming_a_plugins_option_without_the_plugin_says_which_setting_registers_it(tmp_path):
    """A run made with WANDISTILLER_PLUGINS=dummyplugin, read where it is not set: the refusal names the setting;
    a target that is no option's layout (a hostile `pathlib...`) gets no such hint."""
    saved = OmegaConf.create({"method": {"_target_": "dummyplugin.method.dummy.Dummy"}})
    with pytest.raises(UserError) as e:
        received.check_received(saved, tmp_path / "config.yaml")
    hint = "(if dummyplugin is a package of options you installed, set WANDISTILLER_PLUGINS=dummyplugin)"
    assert str(e.value).endswith(hint)
    hostile = OmegaConf.create({"method": {"_target_": "pathlib.Path.write_text"}})
    with pytest.raises(UserError) as e:
        received.check_received(hostile, tmp_path / "config.yaml")
    assert "WANDISTILLER_PLUGINS" not in str(e.value)


def test_a_plugin_yaml_that_is_no_config_or_a_name_two_plugins_share_is_one_line_and_other_folders_are_ignored(
    monkeypatch, tmp_path
):
    for package in ("plugone", "plugtwo"):
        (tmp_path / package / "method").mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "docs").mkdir()
        (tmp_path / package / "docs" / "list.yaml").write_text("- not an option\n")  # no config group: ignored
    (tmp_path / "plugone" / "method" / "fast.yaml").write_text("defaults: [\n  - bad: : :\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(ENV, "plugone")
    with refused("is not a valid config ("):
        register_configs()
    (tmp_path / "plugone" / "method" / "fast.yaml").write_text("_target_: plugone.method.fast.Fast\n")
    (tmp_path / "plugtwo" / "method" / "fast.yaml").write_text("_target_: plugtwo.method.fast.Fast\n")
    monkeypatch.setenv(ENV, "plugone,plugtwo")
    with refused("are both method=fast; rename one"):
        register_configs()
    monkeypatch.setenv(ENV, "plugone")
    register_configs()  # one plugin, its docs/ folder left alone
    repo = ConfigStore.instance().repo
    assert "docs" not in repo and "fast.yaml" in repo["method"]
    repo["method"].pop("fast.yaml")


def test_a_plugin_package_that_cannot_be_imported_is_one_line_from_plan_too(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "no_such_plugin_package")
    monkeypatch.setattr(sys, "argv", ["plan"])
    with pytest.raises(SystemExit) as e:
        plan.main()
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: WANDISTILLER_PLUGINS names")


def test_a_plugin_module_that_fails_on_import_is_one_line_naming_it(monkeypatch, tmp_path, capsys):
    """A plugin's own bug (or a dependency it lacks) is its mistake, not ours: one line from every command that
    reads the options (train, plan, export, eval share the registries), never a traceback or "internal error"."""
    (tmp_path / "broken" / "hooks").mkdir(parents=True)
    (tmp_path / "broken" / "__init__.py").write_text("")
    (tmp_path / "broken" / "hooks" / "mine.py").write_text("raise RuntimeError('boom in the plugin')\n")
    err = plans_refusal(monkeypatch, capsys, tmp_path, "broken")
    assert err.startswith("error: WANDISTILLER_PLUGINS: the plugin module broken.hooks.mine (hooks=mine) fails")
    assert "RuntimeError: boom in the plugin" in err and "drop its package from WANDISTILLER_PLUGINS" in err


def plans_refusal(monkeypatch, capsys, folder: Path, package: str) -> str:
    """`plan`'s one error line (exit 2) with the plugin `package` found in `folder`; afterwards no trace of it."""
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv(ENV, package)
    forget_options()
    monkeypatch.setattr(sys, "argv", ["plan"])
    try:
        with pytest.raises(SystemExit) as e:
            plan.main()
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and "\n" not in err, err
        return err
    finally:
        monkeypatch.delenv(ENV)
        forget_options()
        for name in [m for m in sys.modules if m.split(".")[0] == package.split(".")[0]]:
            del sys.modules[name]


@pytest.mark.parametrize(
    "package, files, said",
    [  # an audit's three tracebacks
        ("badopt", {"hooks/mine.py": "OPTION = 'mine'\n"}, "badopt.hooks.mine.OPTION must be Option('mine', schema"),
        ("badparent.sub", {"__init__.py": "raise RuntimeError('boom')\n", "sub/__init__.py": ""},
         "names 'badparent.sub', whose parent package fails on import (RuntimeError: boom)"),
        ("badschema", {"hooks/mine.py": "from dataclasses import dataclass\nfrom wandistiller.core.registry import "
                       "Option\nclass Foo:\n    pass\n@dataclass\nclass MineConfig:\n    x: Foo = None\nclass Mine:\n"
                       "    pass\nOPTION = Option('mine', MineConfig, Mine)\n"},
         "hooks=mine's schema badschema.hooks.mine.MineConfig is not one OmegaConf can hold"),
    ],
)  # fmt: skip
def test_a_plugin_whose_option_or_package_is_wrong_is_one_line(monkeypatch, tmp_path, capsys, package, files, said):
    root = tmp_path / package.split(".")[0]
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "__init__.py").exists() or (root / "__init__.py").write_text("")
    assert said in plans_refusal(monkeypatch, capsys, tmp_path, package)
