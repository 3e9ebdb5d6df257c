"""`wandistiller.compose`: the one place options are registered (every registry's schemas, the resolvers), composing a
tree or one option outside a Hydra job, Hydra's errors as one line, and older command lines rewritten."""

from __future__ import annotations

import pytest
from hydra.core.config_store import ConfigStore

from wandistiller.compose import (
    auto_precision,
    compose_config,
    compose_option,
    modern_argv,
    register_configs,
    registries,
    resolve_precision,
)
from wandistiller.core.errors import UserError


def test_registration_stores_every_registrys_schemas_and_the_tree():
    register_configs()
    store = ConfigStore.instance()
    assert "train_schema.yaml" in store.list("")
    for registry in registries():
        assert {f"{name}.yaml" for name in registry.names()} <= set(store.list(f"schema/{registry.group}"))
    assert [r.group for r in registries()] == ["teacher_placement", "data", "loss", "method", "hooks", "logger"]


def test_one_option_composes_with_its_schema_and_precision_auto_resolves_to_one():
    assert compose_option("teacher_placement", "disk")._target_ == "wandistiller.placements.disk.DiskPlacement"
    cfg = compose_config(["precision=auto"])
    assert auto_precision(cfg.precision).name in ("fp32", "bf16")
    resolve_precision(cfg)
    assert cfg.precision.name != "auto" and auto_precision(cfg.precision) is cfg.precision


def test_another_sources_name_names_the_data_options():
    with pytest.raises(
        UserError, match=r"choose the data source with data=<option> \(image_folder .*teacher_latents\)"
    ):
        compose_config(["data.latents=teacher"])


def test_an_older_key_on_the_command_line_runs_as_todays_with_a_warning(capsys):
    assert modern_argv(["student.hidden_kd_weight=0.2", "-m", "trainer.max_steps=3"]) == [
        "trainer.loss.hidden_kd_weight=0.2", "-m", "trainer.max_steps=3"]  # fmt: skip
    assert "warning: student.hidden_kd_weight is now trainer.loss.hidden_kd_weight" in capsys.readouterr().err
    assert compose_config(["student.hidden_kd_weight=0.2"]).trainer.loss.hidden_kd_weight == 0.2


def test_a_setting_of_a_hook_the_list_leaves_out_says_to_add_it():
    with pytest.raises(UserError, match=r"that hook is not in the `hooks` list: add it .* or drop the setting$"):
        compose_config(["hooks=[monitor,progress]", "hooks.evaluate.steps=2"])


def test_an_older_hook_setting_is_dropped_where_its_hook_is_not_in_the_list_and_a_sweep_of_two_keys_is_refused():
    assert modern_argv(["debug=fast", "trainer.sample_steps=5"]) == ["debug=fast"]  # debug=fast has no samples
    assert modern_argv(["trainer.eval_at_end=false", "trainer.sample_steps=5"]) == [
        "~hooks.evaluate", "hooks.samples.steps=5"]  # fmt: skip
    assert modern_argv(["-m", "trainer.val_every=5,10"]) == ["-m", "hooks.monitor.val_every=5,10"]
    with pytest.raises(UserError, match=r"^trainer.sample_steps=5,10: a sweep of a key that is now hooks.samples.steps "
                       r"and hooks.evaluate.steps cannot be rewritten as one; sweep the new keys"):  # fmt: skip
        modern_argv(["-m", "trainer.sample_steps=5,10"])
    with pytest.raises(UserError, match=r"hooks=\[monitor,progress,samples\],\[monitor,progress,samples,evaluate\]"):
        modern_argv(["-m", "trainer.eval_at_end=false,true"])


def test_a_key_of_the_method_a_resumed_run_was_trained_with_says_to_choose_that_method(tmp_path):
    from wandistiller.compose import check_overrides

    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("method:\n  name: dmd\n")  # what a dmd run saved (in part)
    argv = [f"hydra.run.dir={run_dir}", "trainer.resume=auto", "trainer.max_steps=6", "method.fake_updates=3"]
    with pytest.raises(UserError, match=r"^Could not override 'method.fake_updates'. Key 'fake_updates' not in "
                       r"'KdConfig'; the run was trained with method=dmd: add method=dmd$"):  # fmt: skip
        check_overrides(argv)
    check_overrides([*argv, "method=dmd"])
    for other in (argv[1:], [*argv[:-1], "method.fake_update=3"]):  # a new run; a typo that dmd lacks too
        with pytest.raises(UserError, match=r"; check its spelling"):
            check_overrides(other)
