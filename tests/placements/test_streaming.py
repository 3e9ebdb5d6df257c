"""Tests of wandistiller/placements/streaming.py, the block streamer behind offload and disk: on the CPU, streamed
teachers give the resident teacher's targets bit for bit; packed blocks, shared host copies and their refusals."""

from __future__ import annotations

import shutil

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import BF16, spawn
from wandistiller.core.distributed import Topology
from wandistiller.core.errors import UserError
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.placements.disk import DiskPlacement
from wandistiller.placements.offload import OffloadPlacement
from wandistiller.placements.streaming import ALIGN, SHM, BlockLayout, node_shared_buffer, pack_blocks
from wandistiller.teacher.spec import inspect_teacher
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
    # checkpointed per block whatever stays resident: the planner counts one block's activations for offload/disk
    assert all(expert.gradient_checkpointing for expert in teacher.experts)
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(4, 16, 1, 8, 8, generator=g), torch.randn(4, 512, 32, generator=g)
    t, uncond = torch.tensor([950.0, 100.0, 880.0, 300.0]), torch.zeros(4, 512, 32)
    for _ in range(3):  # the streamer wraps around from the last block to the first between forwards
        got, got_hidden = teacher.targets(x, t, cond, uncond, layers=(0, -1))
        want, want_hidden = resident_teacher.targets(x, t, cond, uncond, layers=(0, -1))
        assert torch.equal(got, want) and torch.equal(got_hidden, want_hidden)
    assert teacher.copy_ms() > 0 and teacher.copy_ms() == 0.0  # drained: counted once


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


def test_a_streamed_teacher_trains_with_one_teacher_call_per_step(make_cfg, tmp_path):
    overrides = ["teacher_placement=disk", "trainer.grad_accum_steps=2", "trainer.max_steps=2"]
    summary = run(make_cfg(*overrides, "trainer.teacher_whole_step=true", run_dir=tmp_path / "r"))
    assert summary["steps_run"] == 2 and summary["placement"] == "disk"


def adapted_loss_and_grads(teacher, x, t, cond, seed: int = 1, adapters: list | None = None):
    """A LoRA fake score's loss through `teacher` (each sample on the expert serving its t, adapters on, B random so
    every adapter gets a gradient) and the adapters' gradients, by name. `adapters`: a list that keeps the adapters
    made by the first call for the next ones (their gradients cleared), as a run makes them once; None: new ones."""
    from wandistiller.teacher.lora import Adapters

    if not adapters:
        made = [Adapters(e, 2, torch.float32, seed + k) for k, e in enumerate(teacher.experts)]
        adapters = made if adapters is None else (adapters.extend(made) or adapters)
    for p in (p for a in adapters for p in a.parameters()):
        p.grad = None
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a in adapters:
            for p in a.up.values():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    which, loss = teacher.expert_index(t), torch.zeros(())
    for k, expert in enumerate(teacher.experts):
        rows = (which == k).nonzero().flatten()
        with adapters[k].active():
            v = expert(hidden_states=x[rows].to(teacher.dtype), timestep=t[rows],
                       encoder_hidden_states=cond[rows].to(teacher.dtype), return_dict=False)[0]  # fmt: skip
        loss = loss + v.float().square().mean()
    loss.backward()
    grads = {f"{k}.{n}": p.grad for k, a in enumerate(adapters) for n, p in a.named_parameters()}
    return loss.detach(), grads


@pytest.mark.parametrize("moe", [False, True], ids=["one_expert", "two_experts"])
@pytest.mark.parametrize("source,resident", [("disk", 0), ("host", 1), ("host", 99)])  # 99: every block resident
def test_a_loss_and_its_adapter_gradients_through_a_streamed_teacher_are_the_resident_ones_bit_for_bit(
    tiny_path, tiny_moe_path, moe, source, resident
):
    spec = inspect_teacher(tiny_moe_path if moe else tiny_path)
    resident_teacher = CpuPlacement().load(spec, TEACHER, BF16, Topology())
    streamed = {"host": OffloadPlacement, "disk": DiskPlacement}[source](resident_blocks=resident)
    streamed.teacher_device = lambda topology: torch.device("cpu")  # offload's streaming code, on the CPU
    teacher = streamed.load(spec, TEACHER, BF16, Topology())
    # checkpointed per block whatever stays resident: the planner counts one block's activations for offload/disk
    assert all(expert.gradient_checkpointing for expert in teacher.experts)
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(4, 16, 1, 8, 8, generator=g), torch.randn(4, 512, 32, generator=g)
    t, uncond = torch.tensor([950.0, 100.0, 880.0, 300.0]), torch.zeros(4, 512, 32)
    for _ in range(2):  # the second pass starts from the slots the first backward left
        want_loss, want = adapted_loss_and_grads(resident_teacher, x, t, cond)
        got_loss, got = adapted_loss_and_grads(teacher, x, t, cond)
        assert torch.equal(got_loss, want_loss) and want_loss > 0
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
        assert all(want[n].abs().sum() > 0 for n in want)  # every adapter of every block got a gradient
        # the teacher's own output (adapters off, no grad) after a backward is still the resident one
        with torch.no_grad():
            assert torch.equal(teacher.targets(x, t, cond, uncond)[0], resident_teacher.targets(x, t, cond, uncond)[0])


@pytest.mark.parametrize(
    "backend,base",
    [
        ("eager", "bf16"),
        ("eager", "fp8"),  # teacher.quantize=fp8: the adapters on Fp8Linear layers, traced alike
        pytest.param("inductor", "bf16", marks=pytest.mark.slow),  # inductor: minutes of C++ builds
    ],
)
def test_compiled_adapted_blocks_streamed_give_the_compiled_resident_loss_and_gradients(tiny_path, backend, base):
    # teacher.compile=true with adapters on a streamed teacher: the compiled block forward runs inside the
    # streamer's hooks and its recomputation in backward, the adapters reached as graph inputs, never streamed.
    # eager: dynamo's tracing and guards alone (the graphs and recompiles), in seconds; inductor: as a run compiles.
    from torch._dynamo.utils import counters

    from wandistiller.teacher.fp8 import Fp8Linear
    from wandistiller.teacher.model import compile_blocks

    spec = inspect_teacher(tiny_path)
    config = OmegaConf.merge(TEACHER, {"quantize": "fp8" if base == "fp8" else None})
    resident_teacher = CpuPlacement().load(spec, config, BF16, Topology())
    teacher = DiskPlacement(resident_blocks=1).load(spec, config, BF16, Topology())
    assert isinstance(teacher.experts[0].blocks[-1].attn1.to_q, Fp8Linear) == (base == "fp8")
    for expert in resident_teacher.experts + teacher.experts:
        compile_blocks(expert, backend=backend)  # as teacher.compile=true: inductor, or dynamo alone (eager)
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(2, 16, 1, 8, 8, generator=g), torch.randn(2, 512, 32, generator=g)
    t, uncond = torch.tensor([950.0, 100.0]), torch.zeros(2, 512, 32)
    graphs, made = [], ([], [])  # each teacher's adapters, made once as a run makes them
    for _ in range(2):
        want_loss, want = adapted_loss_and_grads(resident_teacher, x, t, cond, adapters=made[0])
        got_loss, got = adapted_loss_and_grads(teacher, x, t, cond, adapters=made[1])
        assert all(want[n].abs().sum() > 0 for n in want)
        with torch.no_grad():
            assert torch.equal(teacher.targets(x, t, cond, uncond)[0], resident_teacher.targets(x, t, cond, uncond)[0])
        graphs.append(counters["stats"]["unique_graphs"])
        if backend == "eager":  # the same ops in the same order: bit for bit
            assert torch.equal(got_loss, want_loss) and all(torch.equal(got[n], want[n]) for n in want)
            continue
        # inductor: the streamed forward runs its no-grad graph (recomputed with grad in backward), the resident
        # one the training graph, whose fusions round the bf16 teacher otherwise: the compile tolerance (1e-3 of
        # the loss, tests/test_train.py) for the loss; each adapter gradient in the same direction (measured: its
        # norm up to 1.8% apart, as bf16 rounding through 4 blocks gives: cosine > 0.9998)
        cosine = {n: float(torch.nn.functional.cosine_similarity(got[n].flatten(), want[n].flatten(), 0)) for n in want}
        assert abs(float(got_loss - want_loss)) <= 1e-3 * float(want_loss), (got_loss, want_loss)
        assert min(cosine.values()) > 0.999, sorted(cosine.values())[:3]
    # 5 for 4 blocks: per state (adapters off; again at the targets' doubled batch; on without grad in the streamed
    # forward; on with grad, block 0's input needing none or needing it), not per block; the second pass adds none
    assert graphs[0] == graphs[1] == 5, graphs


def test_two_adapter_sets_on_one_streamed_expert_each_get_the_gradient_of_their_own_forward(tiny_path):
    # a LoRA student's and a LoRA fake score's adapters on the same teacher: each block's recomputation switches on
    # the set that was on when it ran, whichever is on when the backward comes (none: both `active()`s are over)
    from wandistiller.teacher.lora import Adapters

    spec = inspect_teacher(tiny_path)
    teachers = [CpuPlacement().load(spec, TEACHER, BF16, Topology()), DiskPlacement(resident_blocks=1).load(
        spec, TEACHER, BF16, Topology())]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x, cond, t = torch.randn(2, 16, 1, 8, 8, generator=g), torch.randn(2, 512, 32, generator=g), torch.tensor([9.0, 5])
    grads = []
    for teacher in teachers:
        expert = teacher.experts[0]
        sets = [Adapters(expert, 2, torch.float32, seed) for seed in (1, 2)]
        with torch.no_grad():
            for k, a in enumerate(sets):
                for p in a.up.values():
                    p.fill_(0.05 * (k + 1))
        loss = torch.zeros(())
        for a in sets:
            with a.active():
                v = expert(hidden_states=x.to(teacher.dtype), timestep=t, encoder_hidden_states=cond.to(teacher.dtype),
                           return_dict=False)[0]  # fmt: skip
            loss = loss + v.float().square().mean()
        loss.backward()
        grads.append([p.grad for a in sets for p in a.parameters()])
    resident, streamed = grads
    assert all(torch.equal(s, r) for s, r in zip(streamed, resident, strict=True))
    assert not torch.equal(resident[0], grads[0][len(resident) // 2])  # the two sets' gradients differ
