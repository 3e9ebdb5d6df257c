"""`wandistiller.core.hydra`: composing a tree or one option outside a Hydra job (with what
`wandistiller.compose.register_configs` stored: tests/conftest.py registers it once), precision=auto made concrete,
Hydra's errors as one line, older command lines rewritten, and the package's assets."""

from __future__ import annotations

from pathlib import Path

import pytest

from wandistiller.core.errors import UserError
from wandistiller.core.hydra import (
    auto_precision,
    compose_config,
    compose_option,
    modern_argv,
    resolve_precision,
    shipped_asset,
)


def test_one_option_composes_with_its_schema_and_precision_auto_resolves_to_one():
    assert compose_option("teacher_placement", "disk")._target_ == "wandistiller.placements.disk.DiskPlacement"
    cfg = compose_config(["precision=auto"])
    assert auto_precision(cfg.precision).name in ("fp32", "bf16")
    resolve_precision(cfg)
    assert cfg.precision.name != "auto" and auto_precision(cfg.precision) is cfg.precision


def test_another_sources_name_names_the_data_options():
    with pytest.raises(
        UserError, match=r"choose the data source with data=<option> \(image_folder .*teacher_latents video_folder\)"
    ):
        compose_config(["data.latents=teacher"])


@pytest.mark.parametrize(
    "override,fix",
    [  # issue 41: each refused in Hydra's words alone, with no fix
        ("~trainer.optimizer", "; trainer.optimizer is required, so it cannot be removed: set it instead"),
        ("~teacher.path", "; teacher.path is required, so it cannot be removed: set it instead (teacher.path=…)"),
        ("~hooks", "; `~` removes only a hook, a logger or a key added with + (e.g. ~hooks.evaluate): set this one"),
        ("~trainer.bacth_size", "; `~` removes only a hook, a logger or a key added with +"),
    ],
)
def test_removing_a_key_the_config_needs_or_has_not_says_what_to_do(override, fix):
    with pytest.raises(UserError) as e:
        compose_config([override])
    assert fix in str(e.value) and "\n" not in str(e.value)


def test_an_older_key_on_the_command_line_runs_as_todays_with_a_warning(capsys):
    assert modern_argv(["student.hidden_kd_weight=0.2", "-m", "trainer.max_steps=3"]) == [
        "trainer.loss.hidden_kd_weight=0.2", "-m", "trainer.max_steps=3"]  # fmt: skip
    assert "warning: student.hidden_kd_weight is now trainer.loss.hidden_kd_weight" in capsys.readouterr().err
    assert compose_config(["student.hidden_kd_weight=0.2"]).trainer.loss.hidden_kd_weight == 0.2


def test_a_setting_of_a_hook_the_list_leaves_out_says_to_add_it():
    with pytest.raises(UserError, match=r"that hook is not in the `hooks` list: add it .* or drop the setting$"):
        compose_config(["hooks=[monitor,progress]", "hooks.evaluate.steps=2"])


def test_a_setting_of_a_logger_the_list_leaves_out_says_to_add_it():
    """Issue 41: `logger=[csv] logger.wandb.mode=online` was told to write logger.wandb.mode=online, as it had."""
    with pytest.raises(UserError, match=r"that logger is not in the `logger` list: add it \(e.g. logger=\[wandb,csv"):
        compose_config(["logger=[csv]", "logger.wandb.mode=online"])
    with pytest.raises(UserError, match=r"a logger's keys sit under its name"):  # the flat key of before the list
        compose_config(["logger.mode=online"])


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


def test_a_shipped_asset_stays_inside_the_packages_assets():
    assert shipped_asset("pocket/prompts.txt").endswith("wandistiller/assets/pocket/prompts.txt")
    for outside in ("../config.py", "/etc/passwd"):
        with pytest.raises(ValueError, match="leaves the package's assets"):
            shipped_asset(outside)


@pytest.mark.parametrize(
    "argv, line",
    [
        (["-m", "precision=bf16,fp32", "--cfg", "job"], "--multirun with --cfg: Hydra takes one of"),
        (["--info", "--cfg=job"], "--cfg with --info: Hydra takes one of --run, --multirun, --cfg, --info, --shell-c"),
        (["-sc", "-m"], "--multirun with --shell-completion: Hydra takes one of .*--shell-completion at a time$"),
        (["--mult", "--cfg", "job"], "--multirun with --cfg"),  # as Hydra's parser reads them: abbreviated,
        (["-mcjob"], "--multirun with --cfg"),  # and joined
        (["--cfg", "bogus"], r"argument --cfg/-c: invalid choice: 'bogus' .*; python -m wandistiller.train --help"),
    ],
)
def test_two_hydra_modes_are_one_line_not_hydras_traceback(argv, line):
    """`-m … --cfg job` (to see a sweep's config) was Hydra's ValueError traceback, exit code 1."""
    from wandistiller.core.hydra import check_hydra_flags

    with pytest.raises(UserError, match=line) as e:
        check_hydra_flags(argv)
    assert ("drop -m" in str(e.value)) == ("with --cfg" in line and "--multirun" in line)
    # one mode; a value that looks like a flag is a value
    check_hydra_flags(["--cfg", "job", "data.root=-m", "seed=-1", "~hooks.evaluate", "+experiment=pocket"])


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--resolve"], "--resolve resolves the config that --cfg prints: give it with --cfg job"),
        (["--config-dir", "/no/such/conf"], "--config-dir /no/such/conf: no such folder"),
        (["--config-name", "nope"], "--config-name nope: no such config .*the training config is train"),
        (["-cp", "/no/such/conf"], "--config-path /no/such/conf: no such folder"),
        (["--experimental-rerun", "x.pickle"], "no run here leaves the pickle Hydra reruns; continue a run with"),
    ],
)
def test_hydras_other_flag_mistakes_are_one_line_and_help_still_goes_first(argv, line, tmp_path):
    """Each was Hydra's traceback or a block of lines ending in HYDRA_FULL_ERROR, exit code 1."""
    from wandistiller.core.hydra import check_hydra_flags

    with pytest.raises(UserError, match=line):
        check_hydra_flags(argv)
    (tmp_path / "mine.yaml").write_text("seed: 1\n")
    for fine in (["--cfg", "job", "--resolve"], ["--config-name", "train"], ["--config-name", "train.yaml"],
                 ["--config-dir", str(tmp_path), "--config-name", "mine"], ["-cp", "conf"],
                 ["-cp", str(tmp_path), "-cn", "mine"], ["-m", "--cfg", "job", "--help"],
                 ["--config-name", "nope", "--hydra-help"]):  # fmt: skip
        check_hydra_flags(fine)  # Hydra prints its help before it counts modes


def test_overrides_on_both_sides_of_a_flag_are_told_to_go_together():
    # `student=tiny --cfg job trainer.max_steps=1` was Hydra's usage block, "unrecognized arguments", of the second run
    from wandistiller.core.hydra import check_hydra_flags

    with pytest.raises(UserError) as e:
        check_hydra_flags(["student=tiny", "--cfg", "job", "trainer.max_steps=1"])
    assert str(e.value) == (
        "trainer.max_steps=1: the overrides go together, all before or all after the flags (e.g. python -m "
        "wandistiller.train --cfg job student=tiny trainer.max_steps=1)"
    )
    check_hydra_flags(["--cfg", "job", "student=tiny", "trainer.max_steps=1"])
    check_hydra_flags(["student=tiny", "trainer.max_steps=1", "-m"])


@pytest.mark.parametrize("argv", [["--teacher_path", "/x"], ["--batch_size=4", "seed=1"], ["--output_dir", "out"]])
def test_an_old_train_distillation_flag_is_told_its_override(argv):
    # An audit's: Hydra's usage block and "unrecognized arguments", with the mapping only in docs/USAGE.md.
    from wandistiller.core.hydra import LEGACY_FLAGS, check_hydra_flags

    old = argv[0].split("=")[0]
    with pytest.raises(UserError, match=f"^{old} is the old train_distillation.py's flag; write "):
        check_hydra_flags(argv)
    usage = (Path(__file__).resolve().parents[2] / "docs" / "USAGE.md").read_text()
    assert all(f"`{flag}" in usage for flag in LEGACY_FLAGS)  # each one the table maps


def test_a_key_inside_a_map_is_told_to_be_added_with_plus_not_to_choose_the_option_that_is_chosen():
    # A map merged into a struct map (the device_map yaml's old default) named the chosen option as the one to choose;
    # a review's: Hydra's own maps (hydra.job.env_set.FOO=bar) lost Hydra's "+" hint, told to check the spelling.
    from hydra.errors import HydraException

    from wandistiller.core.hydra import hydra_error_line

    for full, key in (("teacher_placement.strategy", "blocks"), ("hydra.job.env_set.FOO", "FOO")):
        line = hydra_error_line(HydraException(f"Could not override '{full}'. Key '{key}' is not in struct"))
        added = full if full.endswith(key) else f"{full}.{key}"
        assert line.endswith(f"; an entry a map does not have yet is added with +: +{added}=…")


@pytest.mark.parametrize("choice", ["disabled", "none", "stdout", "wandistiller"])
def test_any_of_hydras_job_logging_options_replaces_the_runs_whole(choice):
    """train.log per rank is an option of Hydra's group (train.yaml chooses it): hydra/job_logging=disabled once got
    its file handler's filename merged in, with no class, and Hydra's logging setup raised a traceback."""
    from omegaconf import OmegaConf

    from wandistiller.core.hydra import compose_tree

    cfg = compose_tree("train", [f"hydra/job_logging={choice}"], with_hydra=True)
    node = OmegaConf.to_container(cfg.hydra.job_logging, resolve=False)
    handlers = node.get("handlers", {})
    assert all("class" in h for h in handlers.values()), handlers  # logging's dictConfig needs each one's class
    assert ("file" in handlers) == (choice == "wandistiller")
    if "file" in handlers:
        assert handlers["file"]["filename"].endswith("${hydra.job.name}${wd_rank_suffix:}.log")
