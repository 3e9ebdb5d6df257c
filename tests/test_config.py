"""`wandistiller.config`: every group option composes; typos and wrong types fail at composition, Hydra's own
mistakes in one line; `--cfg job` shows the tree. Real Hydra composition, and the CLI in fresh processes."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException, HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tests.conftest import CONF, cli, fresh_runs
from wandistiller.core.errors import UserError

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")
MISTAKES = [
    ("trainer.bacth_size=2", "Key 'bacth_size' not in 'TrainerConfig'; check its spelling"),
    ("teacher_placement=cpuu", "Could not find 'teacher_placement/cpuu'"),
    ("student.init=teachr", "student.init=teachr is not auto, random or teacher, nor a folder"),
]


def test_every_group_has_options_and_a_schema_and_every_schema_a_group():
    from wandistiller.config import TrainConfig

    presets = {"experiment", "debug"}  # added with `+group=…`: no key of their own in the schema
    for group in GROUPS:
        assert sorted((CONF / group).glob("*.yaml")), f"conf/{group}/ holds no option"
        if group not in presets:  # its own key, or the key its options are packaged at (`# @package trainer.loss`)
            first = (sorted((CONF / group).glob("*.yaml"))[0]).read_text().splitlines()[0]
            key = first.split("@package", 1)[1].strip().split(".")[0] if "@package" in first else group
            assert key in TrainConfig.__dataclass_fields__, f"conf/{group}/ has no schema in TrainConfig"
    groups_of_schema = {k for k, f in TrainConfig.__dataclass_fields__.items() if f.default == "???"}
    assert groups_of_schema - {"paths", "recipe"} <= set(GROUPS)  # every required schema key is a group


@pytest.mark.parametrize("group,option", [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))])
def test_every_option_composes_and_resolves(make_cfg, group, option):
    # Keys an option leaves for the user on purpose (??? in its YAML).
    deliberate = {
        ("student", "from_json"): ["student.config_path=/x/config.json"],
        ("distributed", "multi_node"): ["distributed.rdzv_endpoint=node0:29500"],
    }
    extra = deliberate.get((group, option), [])
    prefix = "+" if group == "experiment" else ""  # presets are added, not chosen from a default
    cfg = make_cfg(f"{prefix}{group}={option}", *extra)
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    if group == "loss":  # `# @package trainer.loss`: the group fills the loop's key
        assert container["trainer"]["loss"]["_target_"].startswith("wandistiller.recipe.losses.")
        return
    global_presets = ("experiment", "debug")  # @package _global_: they set keys elsewhere
    assert container[group] is not None if group not in global_presets else container["trainer"]["max_steps"] > 0


@pytest.mark.parametrize(
    "override",
    [
        "teacher_placement=nowhere",  # unknown option
        "precision=fp8",  # unknown option
        "trainer.batch_size=four",  # wrong type
        "trainer.batchsize=4",  # typo in a key
        "teacher.guidance_scale=high",  # wrong type
        "precision.student_dtype=magic",  # not one of the enum's values
        "data.latents=photos",
        "teacher.builtin=huge",
        "precision.teacher_dtype=fp8",
        "trainer.lr_scheduler=cosin",
        "logger.wandb.mode=onlin",
        "logger.mode=online",  # the flat keys of before the list of loggers
        "teacher_placement=cpu teacher_placement.resident_blocks=3".split()[1],  # offload's key, not cpu's
    ],
)
def test_bad_overrides_fail_at_composition(make_cfg, override):
    with pytest.raises((ConfigCompositionException, HydraException, OmegaConfBaseException)):
        make_cfg("teacher_placement=cpu", override)


def test_an_enum_typo_lists_the_valid_values_in_one_line():
    from wandistiller.core.errors import UserError
    from wandistiller.core.hydra import compose_config

    with pytest.raises(UserError, match=r"Invalid value 'magic', expected one of \[fp32, bf16, fp16\]"):
        compose_config(["precision.student_dtype=magic"])


@pytest.mark.parametrize("override, group, options", [
    ("logger=[wandb,tensorbord]", "logger", "csv none tensorboard wandb"),
    ("hooks=[monitor,progres]", "hooks", "collapse evaluate monitor profile progress samples"),
])  # fmt: skip
def test_a_typo_inside_a_list_of_options_lists_that_groups_options_in_one_line(override, group, options):
    from wandistiller.core.errors import UserError
    from wandistiller.core.hydra import compose_config

    # Hydra names no options for an entry of a list ("Could not load 'logger/tensorbord'."); the line does.
    with pytest.raises(UserError, match=f"Available options in '{group}': {options}; pick one of those options"):
        compose_config([override])


def test_schema_defaults_do_not_contradict_the_yaml():
    # Regression: TrainerConfig said max_steps 100, lr 1e-4, warmup 0 where the YAML said 200, 1e-3, 10.
    from wandistiller.config import DataCommon, TrainerConfig

    trainer = OmegaConf.structured(TrainerConfig)
    # schedule_steps: None in the schema as in the YAML, so a run saved before the key existed still merges with it
    # (its resume sets the length its first launch trained with: job/resumed.py).
    assert all(OmegaConf.is_missing(trainer, k) for k in trainer if k != "schedule_steps")
    assert trainer.schedule_steps is None and OmegaConf.load(CONF / "trainer" / "default.yaml").schedule_steps is None
    data, default_yaml = OmegaConf.structured(DataCommon), OmegaConf.load(CONF / "data" / "static_prompts.yaml")
    assert all(OmegaConf.is_missing(data, k) for k in default_yaml if k != "defaults")


@pytest.fixture(scope="module", autouse=True)  # autouse: they start with the module, beside its in-process tests
def clis(request, tmp_path_factory):
    """This module's command-line runs, started together (each a fresh process); a mistake's run with its folder."""
    commands = {
        "cfg": ("test_cfg_job_prints_the_composed_tree", cli("--cfg", "job", "teacher=tiny_moe", "precision=fp32")),
        "unknown": ("test_unknown_option_on_the_command_line_is_one_clear_message", cli("teacher_placement=nowhere")),
    }  # fmt: skip
    folder = {override: tmp_path_factory.mktemp("cli") for override in dict(MISTAKES)}
    for override in dict(MISTAKES):
        commands[override] = ("test_hydras_own_mistakes_are_one_line_with_exit_code_2",
                              cli(f"hydra.run.dir={folder[override] / 'run'}", override))  # fmt: skip
    started = fresh_runs(request, commands)
    return {key: (run, folder[key]) if key in folder else run for key, run in started.items()}


def test_cfg_job_prints_the_composed_tree(clis):
    result = clis["cfg"].result()
    assert result.returncode == 0, result.stderr
    tree = OmegaConf.create(result.stdout)
    assert tree.teacher.name == "tiny_moe" and tree.precision.teacher_dtype == "fp32"
    assert tree.teacher_placement._target_ == "wandistiller.placements.cpu.CpuPlacement"


def test_unknown_option_on_the_command_line_is_one_clear_message(clis):
    result = clis["unknown"].result()
    assert result.returncode != 0
    assert "teacher_placement" in result.stderr and "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize("override,words", MISTAKES)
def test_hydras_own_mistakes_are_one_line_with_exit_code_2(override, words, clis):
    future, tmp_path = clis[override]
    result = future.result()
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ") and words in result.stderr
    assert "+trainer" not in result.stderr and not (tmp_path / "run").exists()  # no hint that is then refused


def test_the_written_out_schedules_are_the_ones_diffusers_get_scheduler_knows():
    from diffusers.optimization import SchedulerType

    from wandistiller.config import SCHEDULERS, LrScheduler

    assert list(SCHEDULERS) == [s.value for s in SchedulerType] == [c.value for c in LrScheduler]


def test_a_key_of_the_old_flat_logger_names_the_new_place(make_cfg):
    from wandistiller.core.hydra import compose_config

    with pytest.raises(UserError, match=r"logger.wandb.mode=online"):
        compose_config(["logger.mode=online"])


def test_the_cache_resolves_without_home_where_wandistiller_cache_is_set(monkeypatch, tmp_path):
    # An audit's: HOME unset (cron, a container) was refused though WANDISTILLER_CACHE named the cache: the fallback
    # inside the interpolation was resolved first.
    from wandistiller.core.hydra import compose_config

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setenv("WANDISTILLER_CACHE", str(tmp_path / "cache"))
    assert compose_config([]).paths.cache_dir == str(tmp_path / "cache")
    monkeypatch.delenv("WANDISTILLER_CACHE")
    assert compose_config([]).paths.cache_dir == "~/.cache/wandistiller"  # the user's home, expanded where it is used
