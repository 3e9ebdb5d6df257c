"""Every group option composes; typos and wrong types fail at composition; `--cfg job` shows the tree."""

from __future__ import annotations

import pytest
from conftest import CONF, run_cli
from hydra.errors import ConfigCompositionException, HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")


def test_every_group_is_tested_and_non_empty():
    assert {"teacher", "teacher_placement", "precision", "data", "student", "trainer", "logger", "distributed"} <= set(
        GROUPS
    )


@pytest.mark.parametrize("group,option", [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))])
def test_every_option_composes_and_resolves(make_cfg, group, option):
    extra = ["student.config_path=/x/config.json"] if (group, option) == ("student", "from_json") else []
    prefix = "+" if group == "experiment" else ""  # presets are added, not chosen from a default
    cfg = make_cfg(f"{prefix}{group}={option}", *extra)
    container = OmegaConf.to_container(cfg, resolve=True)
    assert container[group] is not None if group != "experiment" else container["trainer"]["max_steps"] > 0


def test_placement_targets_point_at_classes(make_cfg):
    from hydra.utils import get_class

    for option in (CONF / "teacher_placement").glob("*.yaml"):
        cfg = make_cfg(f"teacher_placement={option.stem}")
        cls = get_class(cfg.teacher_placement._target_)
        if option.stem == "auto":  # resolved by the planner into one of the others
            continue
        placement = cls(**{k: v for k, v in cfg.teacher_placement.items() if k != "_target_"})
        assert placement.name == option.stem and placement.serving in ("local", "node_owner", "dedicated_owner")
        assert callable(placement.load) and callable(placement.check) and callable(placement.teacher_device)


@pytest.mark.parametrize(
    "override",
    [
        "teacher_placement=nowhere",  # unknown option
        "precision=fp8",  # unknown option
        "trainer.batch_size=four",  # wrong type
        "trainer.batchsize=4",  # typo in a key
        "teacher.guidance_scale=high",  # wrong type
    ],
)
def test_bad_overrides_fail_at_composition(make_cfg, override):
    with pytest.raises((ConfigCompositionException, HydraException, OmegaConfBaseException)):
        make_cfg(override)


def test_cfg_job_prints_the_composed_tree():
    result = run_cli("--cfg", "job", "teacher=tiny_moe", "precision=fp32")
    assert result.returncode == 0, result.stderr
    tree = OmegaConf.create(result.stdout)
    assert tree.teacher.name == "tiny_moe" and tree.precision.teacher_dtype == "fp32"
    assert tree.teacher_placement._target_ == "wandistiller.placement.CpuPlacement"


def test_unknown_option_on_the_command_line_is_one_clear_message():
    result = run_cli("teacher_placement=nowhere")
    assert result.returncode != 0
    assert "teacher_placement" in result.stderr and "Traceback" not in result.stderr + result.stdout
