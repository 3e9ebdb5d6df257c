"""`wandistiller.recipe.context`: a `RunContext` built from real topologies, roles, placements and the tiny teacher's
spec; which rank is main, which makes the teacher's data, the latent shape, and that it cannot be changed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from wandistiller.core.distributed import Topology, roles_for
from wandistiller.core.precision import Precision
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.placements.sharded import ShardedPlacement
from wandistiller.recipe.context import RunContext
from wandistiller.teacher.spec import inspect_teacher

DATA = OmegaConf.create({"latent_frames": 3, "latent_height": 8, "latent_width": 12})
FP32 = OmegaConf.create({"name": "fp32", "teacher_dtype": "fp32", "student_dtype": "fp32", "autocast_dtype": None})


def context(spec, placement, rank: int, world_size: int, run_dir) -> RunContext:
    """One process's context: `rank` of `world_size` processes on one node."""
    topo = Topology(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)
    return RunContext(
        teacher_cfg=OmegaConf.create({}), data_cfg=DATA, trainer_cfg=OmegaConf.create({}),
        student_cfg=OmegaConf.create({}), seed=0, cache_dir=str(run_dir / "cache"), spec=spec, placement=placement,
        topo=topo, roles=roles_for(placement.serving, topo), precision=Precision.from_config(FP32),
        device=torch.device("cpu"), run_dir=run_dir, teacher_path=str(spec.path),
    )  # fmt: skip


def test_the_latent_shape_is_the_teachers_channels_and_the_datas_frames_and_size(tiny_path, tmp_path):
    ctx = context(inspect_teacher(tiny_path), CpuPlacement(), 0, 1, tmp_path)
    assert ctx.latent_shape == (16, 3, 8, 12)  # the tiny teacher's 16 latent channels
    assert ctx.is_main and ctx.makes_teacher_data  # one process does everything
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.seed = 1  # the facts of a run are settled before its setup: never rewritten


def test_with_a_served_teacher_only_rank_0_makes_its_data_and_the_first_student_is_main(tiny_path, tmp_path):
    spec = inspect_teacher(tiny_path)
    ranks = [context(spec, CpuPlacement(), rank, 3, tmp_path) for rank in range(3)]  # cpu: rank 0 serves its node
    assert [ctx.makes_teacher_data for ctx in ranks] == [True, False, False]
    assert [ctx.is_main for ctx in ranks] == [True, False, False]


def test_a_collective_teacher_has_every_rank_make_its_data(tiny_path, tmp_path):
    spec = inspect_teacher(tiny_path)
    ranks = [context(spec, ShardedPlacement(), rank, 2, tmp_path) for rank in range(2)]  # every rank holds a shard
    assert [ctx.makes_teacher_data for ctx in ranks] == [True, True]  # the forwards need every rank
    assert [ctx.is_main for ctx in ranks] == [True, False]  # outputs are still written once


def test_the_run_context_is_frozen_and_says_who_makes_teacher_data(make_cfg, tmp_path):
    from wandistiller.core.distributed import Topology
    from wandistiller.job.preflight import prepare
    from wandistiller.recipe.distillation import DistillationRecipe

    cfg = make_cfg(run_dir=tmp_path / "r")
    recipe = DistillationRecipe(cfg, prepare(cfg, Topology()), Topology())
    ctx = recipe.ctx
    assert ctx.is_main and ctx.makes_teacher_data and ctx.latent_shape[1:] == (1, 8, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.seed = 1
