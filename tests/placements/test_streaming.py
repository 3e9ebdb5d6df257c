"""Streamed teachers (offload, disk): the same targets as a resident teacher, and what the planner makes of them."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import BF16, FP32, choose, spawn, workload
from wandistiller.core.arch import WAN_14B
from wandistiller.core.distributed import Topology
from wandistiller.core.errors import UserError
from wandistiller.core.precision import DTYPES
from wandistiller.placements import memory
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.placements.disk import DiskPlacement
from wandistiller.placements.offload import OffloadPlacement
from wandistiller.placements.streaming import ALIGN, SHM, BlockLayout, node_shared_buffer, pack_blocks
from wandistiller.teacher.model import inspect_teacher
from wandistiller.train import run

TEACHER = OmegaConf.create({"guidance_scale": 4.0, "guidance_scale_2": 3.0})


@pytest.mark.parametrize("source", ["host", "disk"])
@pytest.mark.parametrize("resident", [0, 2])
def test_a_streamed_teacher_gives_the_resident_teachers_targets_bit_for_bit(tiny_moe_path, source, resident):
    # (offload refuses a machine without a GPU at check(); its streaming code runs on the CPU here.)
    spec = inspect_teacher(tiny_moe_path)
    resident_teacher = CpuPlacement().load(spec, TEACHER, BF16, Topology())
    streamed = {"host": OffloadPlacement, "disk": DiskPlacement}[source](resident_blocks=resident)
    streamed.teacher_device = lambda topology: torch.device("cpu")  # compute where the reference does
    teacher = streamed.load(spec, TEACHER, BF16, Topology())
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(4, 16, 1, 8, 8, generator=g), torch.randn(4, 512, 32, generator=g)
    t, uncond = torch.tensor([950.0, 100.0, 880.0, 300.0]), torch.zeros(4, 512, 32)
    for _ in range(3):  # the streamer wraps around from the last block to the first between forwards
        got, got_hidden = teacher.targets(x, t, cond, uncond, want_hidden=True)
        want, want_hidden = resident_teacher.targets(x, t, cond, uncond, want_hidden=True)
        assert torch.equal(got, want) and torch.equal(got_hidden, want_hidden)
    assert teacher.copy_ms() > 0 and teacher.copy_ms() == 0.0  # drained: counted once


def test_a_disk_teacher_trains_on_the_cpu(make_cfg, tmp_path):
    summary = run(make_cfg("teacher_placement=disk", "teacher=tiny_moe", "trainer.max_steps=3", run_dir=tmp_path / "r"))
    assert summary["placement"] == "disk" and summary["steps_run"] == 3
    assert summary["copy_ms_median"] > 0  # the time spent streaming blocks, per step


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_offload_without_a_gpu_is_refused_naming_what_to_use(make_cfg, tmp_path):
    with pytest.raises(UserError, match="teacher_placement=offload .* none is visible; use teacher_placement=cpu"):
        run(make_cfg("teacher_placement=offload", run_dir=tmp_path / "r"))


def test_the_planner_streams_when_the_teacher_does_not_fit_and_refuses_offload_without_ram(make_cfg):
    frame = ["data.latent_height=60", "data.latent_width=104", "student=small", "precision=bf16"]
    cfg = make_cfg(
        "teacher=wan2.1_t2v_14b",
        *frame,
        "hardware.gpus=1",
        "hardware.gpu_memory_gib=24",
        "hardware.host_memory_gib=16",
        "teacher_placement=auto",
    )
    placement, table = choose(cfg)
    assert placement.name == "disk" and "offload     no" in table  # 28.6 GB of pinned RAM do not fit in 16
    outside, block = memory.block_bytes(WAN_14B, 2)
    assert 40 * block + outside == pytest.approx(28.6e9, rel=0.01) and outside < 0.02 * 28.6e9
    kept = [memory.resident_blocks(WAN_14B, 1, DTYPES["bf16"], gib * memory.GiB) for gib in (6, 24, 40, 80)]
    assert kept[0] == 0 and kept == sorted(kept) and kept[-1] == 40


def _shared_offload_worker(teacher_path: str) -> dict:
    """Each rank loads an offload teacher sharing the node's host copy, and reports what it maps."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    topo = Topology.from_env()
    spec = inspect_teacher(__import__("pathlib").Path(teacher_path))
    streamed = OffloadPlacement(resident_blocks=1, share_host_copy=True)
    streamed.teacher_device = lambda topology: torch.device("cpu")
    teacher = streamed.load(spec, TEACHER, BF16, topo)
    resident = CpuPlacement().load(spec, TEACHER, BF16, topo)
    g = torch.Generator().manual_seed(topo.rank)
    x, cond = torch.randn(2, 16, 1, 8, 8, generator=g), torch.randn(2, 512, 32, generator=g)
    t, uncond = torch.tensor([950.0, 100.0]), torch.zeros(2, 512, 32)
    same = torch.equal(teacher.targets(x, t, cond, uncond)[0], resident.targets(x, t, cond, uncond)[0])
    # The (unlinked) /dev/shm files this process maps, by inode: one per expert, the same on every rank.
    maps = open("/proc/self/maps").read().splitlines()
    inodes = sorted({line.split()[4] for line in maps if "/dev/shm/wandistiller-" in line})
    dist.destroy_process_group()
    return {"same": same, "inodes": inodes, "left": sorted(p.name for p in SHM.glob("wandistiller-*"))}


@pytest.mark.slow  # a 2-rank spawn measuring /dev/shm mappings
def test_ranks_of_a_node_share_one_host_copy_of_an_offload_teacher(tiny_moe_path):

    before = set(SHM.glob("wandistiller-*"))
    results = spawn(_shared_offload_worker, 2, str(tiny_moe_path))
    assert all(r["same"] for r in results.values())  # targets still equal the resident teacher's, bit for bit
    assert len(results[0]["inodes"]) == 2 and results[0]["inodes"] == results[1]["inodes"]  # two experts, one copy
    assert set(SHM.glob("wandistiller-*")) == before  # nothing left behind in /dev/shm


def test_a_shared_host_copy_larger_than_dev_shm_is_refused_naming_the_fix():
    too_big = shutil.disk_usage(SHM).free + 2**30
    with pytest.raises(UserError, match=r"share_host_copy=true .* --shm-size.*share_host_copy=false"):
        node_shared_buffer("wandistiller-test", too_big, Topology(), fill=None)


def test_a_packed_block_views_every_tensor_of_the_block_aligned(tiny_path):
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(tiny_path, subfolder="transformer", use_safetensors=True)
    layout = BlockLayout.of(model.blocks[0])
    buffer = torch.empty(2 * layout.nbytes, dtype=torch.uint8)
    pack_blocks(buffer, layout, [1, 0], lambda i: dict(model.blocks[i].state_dict()))
    views = layout.views(buffer[layout.nbytes :])  # second place: block 0
    assert {n: v.dtype for n, v in views.items()}["scale_shift_table"] == torch.float32  # kept in fp32 by diffusers
    for name, tensor in model.blocks[0].state_dict().items():
        assert torch.equal(views[name], tensor) and (views[name].data_ptr() - buffer.data_ptr()) % ALIGN == 0


def test_the_planner_counts_one_pinned_copy_per_node_unless_told_otherwise(make_cfg):
    hardware = ["hardware.gpus=8", "hardware.gpu_memory_gib=24", "hardware.host_memory_gib=1000"]
    common = ["teacher=wan2.1_t2v_14b", "data.latent_height=60", "data.latent_width=104", "student=small"]
    host = {}
    for share in ("true", "false"):
        cfg = make_cfg(*common, *hardware, "teacher_placement=offload", f"teacher_placement.share_host_copy={share}")
        w, hw = workload(cfg)
        host[share] = OffloadPlacement(share_host_copy=share == "true").estimate(w, hw).host_bytes
    assert host["false"] - host["true"] == pytest.approx(7 * 28.6e9, rel=0.01)  # 8 ranks: 7 copies saved
    assert host["true"] < 2 * 28.6e9


@pytest.mark.slow
def test_a_compiled_streamed_teacher_gives_the_compiled_resident_teachers_targets(tiny_path):
    from torch._dynamo.utils import counters

    from wandistiller.teacher.model import compile_blocks

    spec = inspect_teacher(tiny_path)
    resident = CpuPlacement().load(spec, TEACHER, BF16, Topology())
    streamed = DiskPlacement(resident_blocks=1)
    teacher = streamed.load(spec, TEACHER, BF16, Topology())
    for expert in resident.experts + teacher.experts:
        compile_blocks(expert)
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(2, 16, 1, 8, 8, generator=g), torch.randn(2, 512, 32, generator=g)
    t, uncond = torch.tensor([950.0, 100.0]), torch.zeros(2, 512, 32)
    for _ in range(2):
        assert torch.equal(teacher.targets(x, t, cond, uncond)[0], resident.targets(x, t, cond, uncond)[0])
    assert counters["stats"]["unique_graphs"] == 1  # swapping weights in does not recompile


def test_a_disk_teacher_stored_in_fp32_streams_from_a_bf16_copy_written_once(tiny_moe_path, tmp_path):
    from wandistiller.placements.disk_source import DiskSource

    spec = inspect_teacher(tiny_moe_path)
    # The tiny teacher is saved in fp32.
    assert not DiskSource(tiny_moe_path / "transformer", DTYPES["bf16"]).stored_as_computed()
    resident = CpuPlacement().load(spec, TEACHER, BF16, Topology())
    placement = DiskPlacement(resident_blocks=0, offload_dir=str(tmp_path / "offload"))
    teacher = placement.load(spec, TEACHER, BF16, Topology())
    copies = sorted((tmp_path / "offload").iterdir())
    assert [c.name.split("-")[:2] for c in copies] == [["transformer", "bfloat16"], ["transformer_2", "bfloat16"]]
    assert all(DiskSource(c, DTYPES["bf16"]).stored_as_computed() for c in copies)
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(2, 16, 1, 8, 8, generator=g), torch.randn(2, 512, 32, generator=g)
    t, uncond = torch.tensor([950.0, 100.0]), torch.zeros(2, 512, 32)
    assert torch.equal(teacher.targets(x, t, cond, uncond)[0], resident.targets(x, t, cond, uncond)[0])
    written = {f: f.stat().st_mtime_ns for c in copies for f in c.iterdir()}
    placement.load(spec, TEACHER, BF16, Topology())  # a later run reuses the copy
    assert {f: f.stat().st_mtime_ns for c in copies for f in c.iterdir()} == written


def test_an_offload_dir_that_cannot_be_written_is_refused_naming_the_key(tiny_path, tmp_path):
    (tmp_path / "a_file").write_text("")
    placement = DiskPlacement(offload_dir=str(tmp_path / "a_file" / "offload"))
    with pytest.raises(UserError, match=r"teacher_placement.offload_dir=.* cannot be written .* writable folder"):
        placement.load(inspect_teacher(tiny_path), TEACHER, BF16, Topology())


def test_one_teacher_call_per_step_streams_the_weights_once_for_all_micro_batches(tiny_moe_path):
    from wandistiller.data.prompts import Batch
    from wandistiller.recipe.targets import LocalTargets, WholeStepTargets

    spec = inspect_teacher(tiny_moe_path)

    def batch_fn(step: int, micro: int, rank: int) -> Batch:
        g = torch.Generator().manual_seed(100 * step + micro)
        x, cond = torch.randn(2, 16, 1, 8, 8, generator=g), torch.randn(2, 512, 32, generator=g)
        return Batch(torch.zeros(2), x, torch.tensor([950.0, 100.0]), cond, torch.zeros(2, 512, 32))

    got, loads = {}, {}
    for name, make in [("per_micro", LocalTargets), ("whole_step", lambda t: WholeStepTargets(t, batch_fn, 0, 3))]:
        teacher = DiskPlacement(resident_blocks=0).load(spec, TEACHER, FP32, Topology())
        targets = make(teacher)
        got[name] = [targets.get(step, m, batch_fn(step, m, 0), True) for step in range(2) for m in range(3)]
        loads[name] = sum(s.loads for s in teacher.streamers)
    for (t1, h1), (t2, h2) in zip(got["per_micro"], got["whole_step"]):
        torch.testing.assert_close(t2, t1, rtol=1e-4, atol=1e-5)  # same targets, to rounding
        torch.testing.assert_close(h2, h1, rtol=1e-4, atol=1e-5)
    assert loads["whole_step"] * 2 < loads["per_micro"]  # 3 micro-batches, one stream of each expert per step


def test_a_streamed_teacher_trains_with_one_teacher_call_per_step(make_cfg, tmp_path):
    overrides = ["teacher_placement=disk", "trainer.grad_accum_steps=2", "trainer.max_steps=2"]
    summary = run(make_cfg(*overrides, "trainer.teacher_whole_step=true", run_dir=tmp_path / "r"))
    assert summary["steps_run"] == 2 and summary["placement"] == "disk"


def test_one_teacher_call_per_step_is_refused_where_an_owner_serves_the_targets(make_cfg, tmp_path):
    overrides = ["teacher_placement=gpu0", "teacher_placement.debug_cpu=true", "distributed.nproc_per_node=2"]
    with pytest.raises(UserError, match="trainer.teacher_whole_step=true .* teacher_placement=gpu0 .* drop"):
        run(make_cfg(*overrides, "trainer.teacher_whole_step=true", run_dir=tmp_path / "r"))


def test_the_planner_sizes_the_teachers_activations_for_a_whole_step(make_cfg):
    common = ["teacher=wan2.1_t2v_14b", "data.latent_height=60", "data.latent_width=104", "student=small"]
    hardware = ["hardware.gpus=1", "hardware.gpu_memory_gib=24", "teacher_placement=offload"]
    streaming = {}
    for whole in ("false", "true"):
        cfg = make_cfg(*common, *hardware, "trainer.grad_accum_steps=8", f"trainer.teacher_whole_step={whole}")
        w, hw = workload(cfg)
        e = OffloadPlacement().estimate(w, hw)
        streaming[whole] = e.gpu_bytes[0] - e.resident_blocks * memory.block_bytes(w.teacher_config, 2)[1]
    act = memory.teacher_activation_bytes(replace(w, teacher_batch_size=0))
    assert memory.teacher_activation_bytes(w) == 8 * act  # 8 micro-batches in one teacher call
    # At 8x the batch the teacher's transient forward, not the student's backward, is the GPU's peak.
    teacher_phase = int((memory.student_state_bytes(w, grads=False) + 8 * act) * (1 + memory.FIT_MARGIN))
    assert memory.beside_teacher_bytes(w) == teacher_phase + memory.CUDA_CONTEXT
    assert streaming["true"] - streaming["false"] > 2 * act


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
