"""Tests of wandistiller/placements/device_map.py, one teacher per node spread over its GPUs by accelerate: its
refusals (no GPU, no strategy), the even spread it plans and `sequential_shares` (GPU 0 first), on plain dataclasses."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import BF16
from tests.placements.test_memory import machine, tiny_workload
from wandistiller.core.distributed import Topology, World, gpu_count
from wandistiller.core.errors import UserError
from wandistiller.placements import memory, planner_candidates
from wandistiller.placements.device_map import DeviceMapPlacement, sequential_shares

ONE = World(nproc_per_node=1, nnodes=1)


@pytest.mark.skipif(gpu_count() > 0, reason="checks the refusal on a machine without a GPU")
def test_a_device_map_without_a_gpu_is_refused_naming_cpu():
    with pytest.raises(UserError, match="teacher_placement=device_map spreads the teacher over GPUs .* use .*=cpu"):
        DeviceMapPlacement(strategy={"": 0}).check(BF16, ONE)


def test_a_device_map_without_a_strategy_is_refused_naming_the_key_and_the_named_strategies():
    with pytest.raises(UserError, match=r"needs teacher_placement.strategy, a map of module to GPU, e.g. "
                       r"'teacher_placement.strategy=\{patch_embedding: 0, .*'.*; or use .*=balanced"):  # fmt: skip
        DeviceMapPlacement(debug_cpu=True).check(BF16, ONE)
    DeviceMapPlacement(strategy={"": 0}, debug_cpu=True).check(BF16, ONE)
    assert DeviceMapPlacement(debug_cpu=True).teacher_device(Topology(local_rank=1)) == torch.device("cpu")


@pytest.mark.parametrize(
    "strategy, max_memory, line",
    [
        ("banana", None, r"strategy=banana is no strategy accelerate names \(auto, balanced, balanced_low_0, sequent"),
        ([0, 1], None, r"strategy=\[0, 1\] is no map of module to GPU"),
        ({"blocks": "gpu1"}, None, r"strategy puts blocks on 'gpu1'; give a GPU index \(0, 1, …\), cuda:N, cpu or"),
        ({"blocks": -1}, None, r"strategy puts blocks on -1"),
        ("balanced", 7, r"max_memory=7 is no map of GPU to cap"),
        ("balanced", {"gpu0": "2GiB"}, r"max_memory caps 'gpu0'; give a GPU index"),
        ("balanced", {0: "lots"}, r"max_memory caps GPU 0 at 'lots'; give a size, e.g. 20GiB"),
    ],
)
def test_a_strategy_or_cap_accelerate_cannot_read_is_one_line_before_any_gpu_is_asked(strategy, max_memory, line):
    # An audit's: each was accelerate's traceback at load, after the teacher's wait; the yaml's own example map was
    # refused as "not in struct" (merged into the default {"": 0}), so the default is now none.
    with pytest.raises(UserError, match=f"^teacher_placement.{line}"):
        DeviceMapPlacement(strategy, max_memory).check(BF16, ONE)
    # what accelerate takes: an index, cuda:N, cpu, disk; a cap as a size string or bytes (2e10 too: a review's)
    fine = DeviceMapPlacement({"blocks": 0, "rope": "cpu", "norm_out": "cuda:1", "proj_out": "disk"}, {0: 2e10})
    DeviceMapPlacement({"blocks": 0}, {0: "20GiB", "cpu": 10**9}, debug_cpu=True).check(BF16, ONE)
    fine.check_settings()


def test_the_yamls_example_map_is_taken_from_the_command_line():
    from wandistiller.compose import register_configs
    from wandistiller.core.hydra import compose_config
    from wandistiller.placements.device_map import EXAMPLE

    register_configs()
    cfg = compose_config(["teacher_placement=device_map", f"teacher_placement.strategy={EXAMPLE}"])
    assert dict(cfg.teacher_placement.strategy)["blocks"] == 1 and "" not in cfg.teacher_placement.strategy


def test_a_hand_written_map_is_planned_as_an_even_spread_with_the_activations_on_gpu_0():
    assert DeviceMapPlacement().estimate(tiny_workload(), machine(0)).note == "needs a GPU"
    w, hw = tiny_workload(ranks_per_node=2), machine(4)
    share = memory.teacher_weight_bytes(w) // 4
    student, act = memory.student_device_bytes(w), memory.teacher_activation_bytes(w)
    estimate = DeviceMapPlacement(strategy={"": 0}).estimate(w, hw)
    assert estimate.gpu_bytes == (share + act + student, share + student, share, share)  # 2 ranks train
    assert estimate.host_bytes == 2 * memory.host_process_bytes(hw)
    assert "device_map" not in {p.name for p in planner_candidates()}  # the user's own map: auto never picks it


def test_sequential_shares_fill_gpu_0_first_and_leave_what_fits_nowhere_on_the_last():
    w = tiny_workload()
    weights, beside = (
        memory.teacher_weight_bytes(w),
        memory.student_device_bytes(w) + memory.teacher_activation_bytes(w),
    )
    assert sequential_shares(w, machine(3)) == [weights, 0, 0]
    half = machine(3, gpu_bytes=beside + weights // 2, headroom_fraction=0.0)
    assert sequential_shares(w, half) == [weights // 2, weights - weights // 2, 0]
    assert sequential_shares(w, machine(2, gpu_bytes=beside)) == [0, weights]  # over every cap: the last holds it
