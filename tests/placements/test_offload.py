"""Tests of wandistiller/placements/offload.py, the teacher streamed from pinned RAM: its refusals, its estimate
(pinned copies, resident blocks), how a plan sizes its resident blocks, and the name its ranks share a copy by."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import BF16, choose, workload
from tests.placements.test_memory import machine, tiny_workload
from wandistiller.core.distributed import Topology
from wandistiller.core.errors import UserError
from wandistiller.placements import memory
from wandistiller.placements.offload import OffloadPlacement
from wandistiller.train import run


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_offload_without_a_gpu_is_refused_naming_what_to_use(make_cfg, tmp_path):
    with pytest.raises(UserError, match="teacher_placement=offload .* none is visible; use teacher_placement=cpu"):
        run(make_cfg("teacher_placement=offload", run_dir=tmp_path / "r"))


def test_the_planner_counts_one_pinned_copy_per_node_unless_told_otherwise(make_cfg):
    hardware = ["hardware.gpus=8", "hardware.gpu_memory_gib=24", "hardware.host_memory_gib=1000"]
    common = ["teacher=wan2.1_t2v_14b", "data.latent_height=60", "data.latent_width=104", "student=small"]
    host = {}
    for share in ("true", "false"):
        placed = ["teacher_placement=offload", f"teacher_placement.share_host_copy={share}"]
        w, hw = workload(make_cfg(*common, *hardware, *placed, "teacher_placement.resident_blocks=0"))
        host[share] = OffloadPlacement(resident_blocks=0, share_host_copy=share == "true").estimate(w, hw).host_bytes
    # 8 ranks: 7 copies saved of the 40 streamed blocks (28.1 GB; what is outside the blocks sits on each GPU)
    assert host["false"] - host["true"] == pytest.approx(7 * 28.1e9, rel=0.01)
    assert host["true"] < 2 * 28.1e9


def test_the_planner_keeps_what_fits_of_a_streamed_teacher_resident_and_the_run_uses_its_count(make_cfg):
    frame = ["teacher=wan2.1_t2v_14b", "data.latent_height=60", "data.latent_width=104", "student=small"]
    kept = {}
    for gib in (24, 40, 80):
        hardware = ["hardware.gpus=1", f"hardware.gpu_memory_gib={gib}", "hardware.host_memory_gib=64"]
        placement, table = choose(make_cfg(*frame, *hardware, "teacher_placement=auto", "precision=bf16"))
        kept[gib] = getattr(placement, "resident_blocks", None)
        if gib < 40:
            assert placement.name == "offload" and f"{kept[gib]}/40 blocks resident <- chosen" in table
    assert 0 < kept[24] < 40 and kept[80] is None  # 80 GiB: the whole teacher fits, so `gpu` is chosen


@pytest.mark.parametrize("count", ["many", -1, "2.5"])
def test_a_resident_block_count_that_is_not_auto_or_a_count_is_refused_naming_the_key(count):
    with pytest.raises(UserError, match=rf"teacher_placement.resident_blocks={count!r}: use auto or a count >= 0"):
        OffloadPlacement(resident_blocks=count).check_settings()
    for fine in ("auto", 0, 3, "3"):
        OffloadPlacement(resident_blocks=fine).check_settings()


def test_offload_is_planned_only_on_a_gpu_with_every_kept_block_beside_two_streaming_slots():
    w = tiny_workload(experts=2, ranks_per_node=2)
    assert OffloadPlacement().estimate(w, machine(0)) == memory.Estimate.refused("offload", "needs a GPU")
    outside, block = memory.block_bytes(w.teacher_config, 2)
    for count, kept in [(1, 1), ("3", 3), (99, 4)]:  # a count beyond the teacher's 4 blocks keeps them all
        estimate = OffloadPlacement(resident_blocks=count).estimate(w, machine(4))
        streaming = 2 * (outside + (2 + kept) * block) + memory.beside_teacher_bytes(w)
        assert estimate.resident_blocks == kept and estimate.gpu_bytes == (streaming, streaming)
        assert f"; {kept}/4 blocks resident" in estimate.note
    assert OffloadPlacement().estimate(w, machine(4)).resident_blocks == 4  # auto: 80 GiB hold the tiny teacher


def test_the_plans_resident_count_replaces_auto_and_never_a_count_the_user_gave():
    plan = memory.Estimate.of("offload", (1,), 1, machine(1), "", resident_blocks=3)
    auto, fixed = OffloadPlacement(), OffloadPlacement(resident_blocks=1)
    auto.with_plan(None)
    assert auto.resident_blocks == "auto"
    auto.with_plan(plan)
    fixed.with_plan(plan)
    assert (auto.resident_blocks, fixed.resident_blocks) == (3, 1)
    # Without a plan, auto on the CPU keeps no block resident (there is no GPU memory to ask).
    assert OffloadPlacement()._resident(None, BF16, torch.device("cpu")) == 0
    assert OffloadPlacement(resident_blocks="2")._resident(None, BF16, torch.device("cpu")) == 2


def test_a_nodes_ranks_share_a_host_copy_under_one_name_per_folder_and_job(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29500")
    two = Topology(rank=1, world_size=2, local_rank=1, local_world_size=2)
    folder = Path("/teachers/wan/transformer")
    name, topology = OffloadPlacement()._share(folder, two)
    assert name.startswith("wandistiller-") and len(name) == len("wandistiller-") + 16 and topology is two
    assert OffloadPlacement()._share(folder, Topology(local_world_size=2))[0] == name  # every rank agrees
    assert OffloadPlacement()._share(folder.with_name("transformer_2"), two)[0] != name
    monkeypatch.setenv("MASTER_PORT", "29501")  # another job on the node: another copy
    assert OffloadPlacement()._share(folder, two)[0] != name
    assert OffloadPlacement(share_host_copy=False)._share(folder, two) is None
    assert OffloadPlacement()._share(folder, Topology()) is None  # one rank: nothing to share
