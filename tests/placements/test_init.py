"""Tests of wandistiller/placements/__init__.py, the registry, parametrised over every YAML: each option composes with
its own schema, instantiates, checks, plans -- and `auto` resolves to each choice through Hydra."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from tests.conftest import BF16, CONF, choose, workload
from wandistiller.core.distributed import World, gpu_count
from wandistiller.core.errors import UserError
from wandistiller.placements import REGISTRY, Placement, Serving
from wandistiller.placements.memory import Estimate

OPTION_NAMES = sorted(p.stem for p in (CONF / "teacher_placement").glob("*.yaml"))
ON_PAPER = ["teacher=wan2.1_t2v_14b", "precision=bf16", "data.latent_height=60", "data.latent_width=104"]


def paper(gpus: int, gib: int, host: int, nproc: int = 1, student: str = "small") -> list[str]:
    hardware = [f"hardware.gpus={gpus}", f"hardware.gpu_memory_gib={gib}", f"hardware.host_memory_gib={host}"]
    return [*ON_PAPER, f"student={student}", *hardware, f"distributed.nproc_per_node={nproc}"]


def test_every_yaml_is_a_registered_option_and_every_option_has_a_yaml():
    assert OPTION_NAMES == sorted(REGISTRY.names())


# How many GPUs each option says it needs (`Placement.min_gpus`), read from the registered classes, so a new placement
# is one module + one YAML: the test below checks its `check` agrees on this machine.
GPUS_NEEDED = {name: REGISTRY.get(name).cls.min_gpus for name in REGISTRY.names() if name != "auto"}


def test_every_option_says_how_many_gpus_it_needs():
    assert sorted(GPUS_NEEDED) == [o for o in OPTION_NAMES if o != "auto"]
    assert all(isinstance(n, int) and 0 <= n <= 8 for n in GPUS_NEEDED.values())
    assert GPUS_NEEDED["cpu"] == 0 and GPUS_NEEDED["gpu0"] == 2  # the two ends: no GPU, a teacher's and a student's


@pytest.mark.parametrize("option", [o for o in OPTION_NAMES if o != "auto"])
def test_each_option_instantiates_checks_and_plans(make_cfg, option):
    cfg = make_cfg(f"teacher_placement={option}", *paper(gpus=8, gib=80, host=1024, nproc=8))
    placement = instantiate(cfg.teacher_placement)
    assert isinstance(placement, Placement) and placement.name == option
    assert isinstance(placement.serving, Serving)
    world = World.of(cfg.distributed, __import__("wandistiller.core.distributed").core.distributed.Topology())
    if gpu_count() >= GPUS_NEEDED[option]:  # on this machine: runs exactly where its GPUs are here
        placement.check(BF16, world)
    else:  # or refuses with one line naming what to use instead
        with pytest.raises(UserError) as refused:
            placement.check(BF16, world)
        assert "teacher_placement" in str(refused.value) and "\n" not in str(refused.value)
        assert "use teacher_placement=" in str(refused.value)
    w, hw = workload(cfg)
    estimate = placement.estimate(w, hw)
    assert isinstance(estimate, Estimate) and estimate.placement == option and estimate.fits
    assert len(estimate.gpu_bytes) == 8 and estimate.host_bytes > 0


@pytest.mark.parametrize("option", OPTION_NAMES)
def test_a_key_the_option_does_not_take_fails_at_composition(make_cfg, option):
    with pytest.raises(ConfigCompositionException):
        make_cfg(f"teacher_placement={option}", "teacher_placement.not_a_key=3")


def test_a_key_of_another_option_fails_at_composition(make_cfg):
    with pytest.raises(ConfigCompositionException, match="resident_blocks"):
        make_cfg("teacher_placement=cpu", "teacher_placement.resident_blocks=3")


AUTO_CHOICES = {  # hardware on paper -> auto's choice
    "gpu": paper(gpus=1, gib=40, host=16),
    # 8 GiB: offload (31 of 40 blocks resident, 9 pinned) is refused by /dev/shm on paper (half the RAM), not the RAM
    "gpu0": paper(gpus=2, gib=80, host=8, student="base"),
    "balanced": paper(gpus=2, gib=28, host=16),
    "sharded": paper(gpus=0, gib=0, host=64, nproc=2),
    "offload": paper(gpus=1, gib=16, host=64),
    "disk": paper(gpus=0, gib=0, host=16),
    "cpu": paper(gpus=0, gib=0, host=64),
}


@pytest.mark.parametrize("choice", sorted(AUTO_CHOICES))
def test_auto_resolves_to_each_choice_composed_by_hydra(make_cfg, choice):
    cfg = make_cfg("teacher_placement=auto", *AUTO_CHOICES[choice])
    placement, table = choose(cfg)
    assert placement.name == choice and f"{choice:<11}" in table and "<- chosen" in table
    node = OmegaConf.to_container(cfg.teacher_placement, resolve=True)  # interpolations resolve in the run's tree
    assert node["_target_"] == f"{type(placement).__module__}.{type(placement).__name__}"


def test_auto_choosing_disk_resolves_its_offload_dir_in_the_runs_cache(make_cfg, cache_dir):
    # Regression: auto reread the YAML outside Hydra, and ${paths.cache_dir} did not resolve.
    cfg = make_cfg("teacher_placement=auto", *paper(gpus=1, gib=24, host=16))
    placement, _ = choose(cfg)
    assert placement.name == "disk" and placement.offload_dir == f"{cache_dir}/offload"
    assert cfg.teacher_placement.offload_dir == f"{cache_dir}/offload"


@pytest.mark.skipif(gpu_count() > 0, reason="auto on this machine: what a machine without a GPU can run")
def test_auto_on_this_machine_runs_the_tiny_teacher(make_cfg, tmp_path):
    from wandistiller.train import run

    summary = run(make_cfg("teacher_placement=auto", "trainer.max_steps=2", run_dir=tmp_path / "r"))
    assert summary["placement"] == "cpu" and summary["steps_run"] == 2
    saved = OmegaConf.load(tmp_path / "r" / ".hydra" / "config.yaml")
    assert saved.teacher_placement._target_.endswith("CpuPlacement")  # the run's config names what ran
