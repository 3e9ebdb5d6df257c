"""`wandistiller.compose`: the one place options are registered (every registry's schemas, the resolvers, handed down
to the layers below through `core.registry.registered`), and a command line's overrides checked before Hydra runs."""

from __future__ import annotations

import re

import pytest
from hydra.core.config_store import ConfigStore

from wandistiller.compose import check_overrides, register_configs, registries
from wandistiller.core.errors import UserError
from wandistiller.core.registry import registered


def test_registration_stores_every_registrys_schemas_and_the_tree():
    register_configs()
    store = ConfigStore.instance()
    assert "train_schema.yaml" in store.list("")
    for registry in registries():
        assert {f"{name}.yaml" for name in registry.names()} <= set(store.list(f"schema/{registry.group}"))
    assert [r.group for r in registries()] == ["teacher_placement", "data", "loss", "method", "hooks", "logger"]
    assert set(registered()) >= set(registries())  # what the received-config check and the preflight read


def test_a_key_of_the_method_a_resumed_run_was_trained_with_says_to_choose_that_method(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("method:\n  name: dmd\n")  # what a dmd run saved (in part)
    argv = [f"hydra.run.dir={run_dir}", "trainer.resume=auto", "trainer.max_steps=6", "method.fake_updates=3"]
    with pytest.raises(UserError, match=r"^Could not override 'method.fake_updates'. Key 'fake_updates' not in "
                       r"'KdConfig'; the run was trained with method=dmd: add method=dmd$"):  # fmt: skip
        check_overrides(argv)
    check_overrides([*argv, "method=dmd"])
    with pytest.raises(UserError, match=r"'KdConfig'; method.fake_updates is a key of method=dmd, not of the method "
                       r"option chosen: choose one with it \(e.g. method=dmd method.fake_updates=…"):  # fmt: skip
        check_overrides(argv[1:])  # a new run: the options that have the key
    with pytest.raises(UserError, match=r"; check its spelling"):
        check_overrides([*argv[:-1], "method.fake_update=3"])  # a typo that no method has
    # An experiment's key for the option it chooses, displaced by another choice given beside it (an audit's find).
    with pytest.raises(UserError, match=r"Key 'dataset' not in 'VideosConfig'; \+experiment=pocket_i2v_fewstep sets "
                       r"keys of the options it chooses, .* drop that choice"):  # fmt: skip
        check_overrides(["+experiment=pocket_i2v_fewstep", "data=video_folder", "data.root=/x"])
    with pytest.raises(UserError, match=r"data.root is a key of data=image_folder, .*data=video_folder, not of"):
        check_overrides(["data.root=/x"])  # a resumed image-folder run's key, its data=image_folder not given


@pytest.mark.parametrize("override", ["trainer..max_steps=3", "hooks=[monitor,progress", "trainer.max_steps=1,2,"])
def test_an_override_that_does_not_parse_is_one_line_naming_it_and_how_to_write_it(override):
    with pytest.raises(UserError, match=re.escape(f"{override} is not an override Hydra can read (")) as e:
        check_overrides([override])
    assert "\n" not in str(e.value) and "a list closed (hooks=[monitor,progress])" in str(e.value)


def test_a_sweep_without_multirun_and_a_hydra_key_that_does_not_parse_are_one_line_each():
    """Hydra's own words for these were several lines and exit code 1: a path with a comma is a sweep to its parser,
    and hydra.* overrides were left to it."""
    with pytest.raises(UserError) as e:
        check_overrides(["data=video_folder", "data.root=/clips/a,b"])
    assert str(e.value) == (
        "data.root=/clips/a,b: a comma makes it a sweep, which runs only with --multirun (-m); for one value holding "
        "a comma, quote it: data.root='/clips/a,b'"
    )
    check_overrides(["-m", "trainer.max_steps=1,2"])  # a sweep, asked for
    with pytest.raises(UserError, match=r"^hydra.run.dir=/tmp/x'5' is not an override Hydra can read \("):
        check_overrides(["hydra.run.dir=/tmp/x'5'"])
    with pytest.raises(UserError, match=r"^hydra.run.dir=/runs/a,b: a comma makes it a sweep, which runs only with"):
        check_overrides(["hydra.run.dir=/runs/a,b"])  # Hydra's "Ambiguous value" was six lines and exit code 1


def test_hydras_own_groups_and_glob_sweeps_are_checked_like_ours():
    """`hydra/launcher=nope` was Hydra's block of lines and exit code 1; every `glob()` sweep failed with "ConfigLoader
    is not set" (the parser had none to list options with); a glob matching nothing would launch no job."""
    with pytest.raises(UserError, match=r"Could not find 'hydra/launcher/nope' Available options in 'hydra/launcher'"
                       r": basic .*submitit_local.*; pick one of those options$"):  # fmt: skip
        check_overrides(["hydra/launcher=nope"])
    check_overrides(["hydra/launcher=basic", "hydra.run.dir=outputs/x", "hydra.job.chdir=false"])
    with pytest.raises(UserError, match=r"^Could not override 'hydra.run.dri'. Key 'dri' not in 'RunDir'; check its "
                       r"spelling \(python -m wandistiller.train --cfg hydra lists Hydra's keys\)$"):  # fmt: skip
        check_overrides(["hydra.run.dri=x"])
    check_overrides(["-m", "student=glob(ti*)"])  # tenth, tiny: each composed
    with pytest.raises(UserError, match=r"^student=glob\(zz\) sweeps over nothing: .* options of student are base"):
        check_overrides(["-m", "student=glob(zz)"])
    with pytest.raises(UserError, match=r"^trainer.lr=glob\(\*\) sweeps over nothing: .* is not a config group; list"):
        check_overrides(["-m", "trainer.lr=glob(*)"])
    # range(1,1) ran no job and said "no point trained (each refused)"; an interval was the basic sweeper's traceback
    with pytest.raises(UserError, match=r"^trainer.max_steps=range\(1,1\) sweeps over nothing: the range is empty"):
        check_overrides(["-m", "trainer.max_steps=range(1,1)"])
    with pytest.raises(UserError, match=r"^trainer.lr=interval\(0,1\): an interval is drawn from by a sampling"):
        check_overrides(["-m", "trainer.lr=interval(0,1)"])
    with pytest.raises(UserError, match=r"Value 'x' of type 'str' could not be converted to Integer"):
        check_overrides(["-m", "trainer.max_steps=range(1,3)", "trainer.batch_size=x"])


@pytest.mark.parametrize(
    "override",
    ["hydra.run.dir=", "hydra.run.dir=''", "paths.cache_dir= ", "hydra.sweep.dir=", "data.root=", "teacher.path=''"],
)
def test_an_empty_folder_is_refused_not_read_as_the_current_directory(override):
    # `hydra.run.dir=$OUT` with OUT unset trained into the current directory (a checkout's root, say).
    key = override.split("=")[0]
    with pytest.raises(UserError, match=rf"^{re.escape(key)} is empty \(an unset variable\?\); give it a folder, e.g."):
        check_overrides(["trainer.max_steps=1", override])


def test_a_value_that_is_no_bool_is_told_what_a_bool_key_takes():
    # An audit's: hardware.show_plan=maybe gave Hydra's words and no fix
    with pytest.raises(UserError, match=r"show_plan=maybe .*'maybe' is not a valid bool .*; use true or false$"):
        check_overrides(["hardware.show_plan=maybe"])


def test_a_value_beyond_ascii_is_told_to_be_quoted():
    # An audit's: data.prompts_path=/tmp/prömpts.txt was told to write key=value with one dot
    with pytest.raises(UserError, match=r"goes in quotes, 'data.prompts_path=\"/tmp/prömpts.txt\"'"):
        check_overrides(["data.prompts_path=/tmp/prömpts.txt"])
    check_overrides(['data.prompts_path="/tmp/prömpts.txt"'])


@pytest.mark.parametrize("spelled", ["+experiment=pocket_lora", "experiment=pocket_lora"])
def test_debug_fast_wins_over_an_experiment_which_keeps_its_choices(spelled):
    """debug=fast with an experiment checks that experiment in 5 steps: the tree lists the experiment before debug
    (it used to be appended after it, and silently ran its 600 steps without a word); both spellings choose it."""
    from wandistiller.core.hydra import compose_config
    from wandistiller.job.checks import drop_settings_of_unlisted_hooks

    register_configs()
    cfg = drop_settings_of_unlisted_hooks(compose_config([spelled, "debug=fast"]))
    assert cfg.trainer.max_steps == 5 and list(cfg.hooks) == ["monitor", "progress"] and not cfg.logger
    assert cfg.teacher.name == "pocket" and cfg.student.builder == "lora"  # the experiment's own choices stay
    assert compose_config([spelled]).trainer.max_steps == 600
    check_overrides([spelled, "debug=fast", "trainer.max_steps=2"])
