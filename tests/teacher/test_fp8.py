"""`wandistiller.teacher.fp8` on the CPU: layers and targets vs bf16, streamed vs resident, RAM, planner, refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open

from tests.conftest import BF16, ROOT, choose, cli, fresh_runs, workload
from wandistiller.core.arch import WAN_14B
from wandistiller.core.distributed import Topology
from wandistiller.core.errors import UserError
from wandistiller.placements import memory
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.placements.disk import DiskPlacement
from wandistiller.placements.offload import OffloadPlacement
from wandistiller.teacher.fp8 import Fp8Linear, quantize_model, quantize_weight, relative_mse, scaled_mm_runs
from wandistiller.teacher.model import load_expert
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.train import run

TEACHER = OmegaConf.create({"guidance_scale": 4.0, "guidance_scale_2": 3.0, "quantize": None})
FP8 = OmegaConf.merge(TEACHER, {"quantize": "fp8"})
COMPUTES = ["dequant"] + (["scaled_mm"] if scaled_mm_runs("cpu") else [])


def _inputs():
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(4, 16, 1, 8, 8, generator=g), torch.randn(4, 512, 32, generator=g)
    return x, torch.tensor([950.0, 100.0, 880.0, 300.0]), cond, torch.zeros(4, 512, 32)


def test_quantized_weights_keep_each_row_within_e4m3_and_zero_rows_stay_zero():
    w = torch.randn(48, 32, dtype=torch.bfloat16)
    w[3] = 0
    q, scale = quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (48, 1) and scale.dtype == torch.float32
    assert q.float().abs().amax(1)[0] == 448  # each row's largest value lands on e4m3's largest
    assert torch.all(q[3].float() == 0)
    assert relative_mse(q.float() * scale, w) < 1e-3


@pytest.mark.parametrize("compute", COMPUTES)
def test_each_fp8_layer_of_the_tiny_teacher_matches_bf16_within_one_percent(tiny_path, compute):
    spec = inspect_teacher(tiny_path)
    expert = load_expert(spec, "transformer", torch.bfloat16)
    linears = {n: m for n, m in expert.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("blocks.")}
    x = torch.randn(2, 77, 64, dtype=torch.bfloat16)
    for name, linear in linears.items():
        layer = Fp8Linear.from_linear(linear, compute)
        inputs = x[..., : linear.in_features] if linear.in_features <= 64 else torch.randn(2, 77, linear.in_features)
        inputs = inputs.to(torch.bfloat16)
        out = layer(inputs)
        assert out.dtype == torch.bfloat16 and out.shape == (2, 77, linear.out_features)
        assert relative_mse(out, linear(inputs)) < 0.01, name
    names = quantize_model(expert, compute)
    assert sorted(names) == sorted(linears) and all(isinstance(expert.get_submodule(n), Fp8Linear) for n in names)


def test_fp8_targets_stay_within_one_percent_relative_mse_of_the_bf16_teachers(tiny_moe_path):
    spec = inspect_teacher(tiny_moe_path)
    reference = CpuPlacement().load(spec, TEACHER, BF16, Topology())
    fp8 = CpuPlacement().load(spec, FP8, BF16, Topology())
    assert all(isinstance(e.blocks[0].ffn.net[2], Fp8Linear) for e in fp8.experts)
    assert not any(isinstance(m, Fp8Linear) for m in fp8.experts[0].proj_out.modules())  # the head stays bf16
    got, want = fp8.targets(*_inputs())[0], reference.targets(*_inputs())[0]
    assert 0 < relative_mse(got, want) < 0.01


def test_quantizing_a_loaded_expert_gives_the_same_bytes_as_loading_it_quantized(tiny_path):
    # bench job's hand-written loop quantizes in memory; the placements read block by block: one arithmetic.
    from wandistiller.teacher.fastpaths import quantize_expert

    spec = inspect_teacher(tiny_path)
    loaded = CpuPlacement().load(spec, FP8, BF16, Topology()).experts[0]
    in_memory = quantize_expert(load_expert(spec, "transformer", torch.bfloat16), "fp8")
    want = in_memory.state_dict()
    assert all(torch.equal(t.view(torch.uint8), want[k].view(torch.uint8)) for k, t in loaded.state_dict().items())


@pytest.mark.parametrize("source", ["host", "disk"])
@pytest.mark.parametrize("resident", [0, 1])
def test_a_streamed_fp8_teacher_gives_the_resident_fp8_teachers_targets_bit_for_bit(tiny_moe_path, source, resident):
    spec = inspect_teacher(tiny_moe_path)
    resident_teacher = CpuPlacement().load(spec, FP8, BF16, Topology())
    streamed = {"host": OffloadPlacement, "disk": DiskPlacement}[source](resident_blocks=resident)
    streamed.teacher_device = lambda topology: torch.device("cpu")  # offload's streaming code, on the CPU
    teacher = streamed.load(spec, FP8, BF16, Topology())
    slot = teacher.streamers[0].slots[0]
    assert slot["attn1.to_q.weight"].dtype == torch.float8_e4m3fn and "attn1.to_q.weight_scale" in slot
    for _ in range(2):  # the streamer wraps around between forwards
        got, got_hidden = teacher.targets(*_inputs(), layers=(0, -1))
        want, want_hidden = resident_teacher.targets(*_inputs(), layers=(0, -1))
        assert torch.equal(got, want) and torch.equal(got_hidden, want_hidden)


@pytest.mark.slow  # two regional compiles on the CPU: ~1 min
def test_a_compiled_streamed_fp8_teacher_gives_the_compiled_resident_fp8_targets(tiny_moe_path):
    from wandistiller.teacher.model import compile_blocks

    spec = inspect_teacher(tiny_moe_path)
    resident, bf16 = (
        CpuPlacement().load(spec, FP8, BF16, Topology()),
        CpuPlacement().load(spec, TEACHER, BF16, Topology()),
    )
    streamed = OffloadPlacement(resident_blocks=0)
    streamed.teacher_device = lambda topology: torch.device("cpu")
    teacher = streamed.load(spec, FP8, BF16, Topology())
    for expert in resident.experts + teacher.experts:
        compile_blocks(expert)  # the fp8 layer traces: _scaled_mm and its scales inside the block's graph
    got, want = teacher.targets(*_inputs())[0], resident.targets(*_inputs())[0]
    assert torch.equal(got, want) and relative_mse(got, bf16.targets(*_inputs())[0]) < 0.01


def test_a_disk_fp8_teacher_streams_the_quantized_tensors_from_its_converted_copy(tiny_moe_path, tmp_path):
    spec = inspect_teacher(tiny_moe_path)
    placement = DiskPlacement(resident_blocks=0, offload_dir=str(tmp_path / "offload"))
    teacher = placement.load(spec, FP8, BF16, Topology())
    copy = teacher.streamers[0].source.folder
    assert copy.parent == tmp_path / "offload" and "fp8" in copy.name
    with safe_open(copy / "blocks-000.safetensors", framework="pt") as f:
        assert f.get_slice("blocks.0.attn1.to_q.weight").get_dtype() == "F8_E4M3"
        assert f.get_tensor("blocks.0.attn1.to_q.weight_scale").dtype == torch.float32
    want = CpuPlacement().load(spec, FP8, BF16, Topology()).targets(*_inputs())[0]
    assert torch.equal(teacher.targets(*_inputs())[0], want)


# -- an fp8 base that trains adapters (student=lora, method.fake_score=lora) ------------------------------------
@pytest.mark.parametrize("compute", COMPUTES)
def test_the_fp8_layer_passes_a_gradient_to_its_input_and_none_to_its_weight(compute):
    layer = Fp8Linear.from_linear(torch.nn.Linear(32, 48).bfloat16(), compute)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    with torch.no_grad():
        assert torch.equal(out, layer(x))  # the same arithmetic with and without a backward to come
    grad = torch.randn_like(out)
    out.backward(grad)
    widened = layer.weight.to(torch.bfloat16) * layer.weight_scale.to(torch.bfloat16)
    assert torch.equal(x.grad, (grad.reshape(-1, 48) @ widened).reshape(x.shape))  # d(x W^T)/dx, W the fp8 one
    assert all(not t.requires_grad and t.grad is None for t in layer.buffers())  # frozen: no weight gradient


def adapter_cosines(fp8: dict, bf16: dict) -> dict[str, float]:
    """Per adapted layer (its A's and B's gradients together, `<expert>.<down|up>.<layer>` -> gradient), the
    cosine of the fp8 base's gradient to the bf16 base's."""
    layer_of = {n: n.replace(".down.", ".").replace(".up.", ".") for n in bf16}
    cosines = {}
    for layer in sorted(set(layer_of.values())):
        names = [n for n in sorted(bf16) if layer_of[n] == layer]
        ours, theirs = (torch.cat([grads[n].flatten() for n in names]) for grads in (fp8, bf16))
        cosines[layer] = float(torch.nn.functional.cosine_similarity(ours, theirs, dim=0))
    return cosines


def test_adapters_on_an_fp8_base_get_the_bf16_bases_gradients_to_a_cosine_of_0_99_per_layer(tiny_moe_path):
    # The figure docs/PERFORMANCE.md states ("fp8"): 2 experts x 4 blocks x 10 adapted Linears, B random so every A
    # and B gets a gradient. Only the frozen base differs; the adapters, inputs and loss are the same.
    from tests.placements.test_streaming import adapted_loss_and_grads

    spec = inspect_teacher(tiny_moe_path)
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(4, 16, 1, 8, 8, generator=g), torch.randn(4, 512, 32, generator=g)
    t = torch.tensor([950.0, 100.0, 880.0, 300.0])
    (loss, grads), (loss_bf16, grads_bf16) = (
        adapted_loss_and_grads(CpuPlacement().load(spec, config, BF16, Topology()), x, t, cond)
        for config in (FP8, TEACHER)
    )
    cosines = adapter_cosines(grads, grads_bf16)
    assert len(cosines) == 2 * 4 * 10 and min(cosines.values()) > 0.99, sorted(cosines.items(), key=lambda c: c[1])[:3]
    assert abs(float(loss / loss_bf16) - 1) < 0.01


@pytest.mark.parametrize("source,resident", [("disk", 0), ("host", 1), ("host", 99)])  # 99: every block resident
def test_adapter_gradients_through_a_streamed_fp8_base_are_the_resident_fp8_ones_bit_for_bit(
    tiny_moe_path, source, resident
):
    from tests.placements.test_streaming import adapted_loss_and_grads

    spec = inspect_teacher(tiny_moe_path)
    resident_teacher = CpuPlacement().load(spec, FP8, BF16, Topology())
    streamed = {"host": OffloadPlacement, "disk": DiskPlacement}[source](resident_blocks=resident)
    streamed.teacher_device = lambda topology: torch.device("cpu")  # offload's streaming code, on the CPU
    teacher = streamed.load(spec, FP8, BF16, Topology())
    assert isinstance(teacher.experts[0].blocks[-1].attn1.to_q, Fp8Linear)
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(4, 16, 1, 8, 8, generator=g), torch.randn(4, 512, 32, generator=g)
    t = torch.tensor([950.0, 100.0, 880.0, 300.0])
    for _ in range(2):  # the second pass starts from the slots the first backward left
        want_loss, want = adapted_loss_and_grads(resident_teacher, x, t, cond)
        got_loss, got = adapted_loss_and_grads(teacher, x, t, cond)
        assert torch.equal(got_loss, want_loss) and got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) and want[n].abs().sum() > 0 for n in want)


@pytest.mark.slow  # a whole run: the default lane keeps its 4 minutes
def test_a_cpu_run_with_an_fp8_teacher_trains(make_cfg, tmp_path):
    cfg = make_cfg("teacher.quantize=fp8", "precision=bf16", "teacher=tiny_moe", "trainer.max_steps=3",
                   run_dir=tmp_path / "r")  # fmt: skip
    summary = run(cfg)
    assert summary["placement"] == "cpu" and summary["steps_run"] == 3 and summary["loss_last"] > 0


@pytest.mark.slow  # a whole run: a LoRA student and dmd's LoRA fake score on one streamed fp8 base, ~15 s
def test_a_lora_student_and_a_lora_fake_score_train_on_a_streamed_fp8_base(make_cfg, tmp_path):
    from wandistiller.state.checkpoint import load_checkpoint

    folder = tmp_path / "r"
    hooks = ["hooks=[monitor,progress,samples]", "hooks.samples.prompts=1"]  # drawn by the fp8 experts, adapters on
    cfg = make_cfg("teacher=tiny_moe", "teacher.quantize=fp8", "precision=bf16", "teacher_placement=disk",
                   "teacher_placement.resident_blocks=1", "student=lora", "student.rank=2", "trainer.batch_size=2",
                   "method=dmd", "method.steps=2", "method.fake_updates=1", "method.fake_score=lora",
                   "method.lora_rank=2", "trainer.max_steps=2", *hooks, run_dir=folder)  # fmt: skip
    summary = run(cfg)
    assert summary["status"] == "completed" and summary["placement"] == "disk" and summary["loss_last"] > 0
    saved = load_checkpoint(folder / "checkpoints" / "step_00000002")
    assert any(v.abs().sum() > 0 for k, v in saved["student"].items() if ".up." in k)  # B trained from zero
    assert (folder / "samples.png").is_file() and (folder / "student" / "pytorch_lora_weights.safetensors").is_file()


# A teacher large enough that its bytes stand out of the interpreter's (~0.3 GiB bf16), small enough to build
# in a second or two: 4 blocks of width 1024.
RSS_CONFIG = dict(num_attention_heads=8, attention_head_dim=128, ffn_dim=4096, num_layers=4, text_dim=64,
                  freq_dim=64, in_channels=16, out_channels=16)  # fmt: skip
RSS_PROBE = """
import ctypes, sys, torch
from pathlib import Path
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
from diffusers import WanTransformer3DModel
from wandistiller.placements.streaming import load_fp8_expert
folder = Path(sys.argv[2]); base = rss()
if sys.argv[1] == "fp8":
    model = load_fp8_expert(folder, torch.bfloat16, torch.device("cpu"))
else:  # what the cpu placement does without teacher.quantize (load_expert)
    model = WanTransformer3DModel.from_pretrained(folder, dtype=torch.bfloat16, use_safetensors=True)
for t in model.state_dict().values():  # read every byte once, as the first forward does (from_pretrained maps the
    t.view(torch.uint8).max()          # files: pages count once they are touched)
ctypes.CDLL("libc.so.6").malloc_trim(0)
print(rss() - base)
"""


@pytest.mark.slow  # a calibration: host RAM measured in fresh processes
def test_an_fp8_teacher_takes_about_half_the_host_ram_of_a_bf16_one(tmp_path):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    with torch.device("meta"):
        skeleton = WanTransformer3DModel(**RSS_CONFIG)
    model = skeleton.to_empty(device="cpu").to(torch.bfloat16)
    for p in model.parameters():
        p.data.normal_(0, 0.02)  # fast; the values do not matter, the bytes do
    model.save_pretrained(tmp_path / "t")
    teacher_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # What an fp8 teacher holds: the blocks' Linear weights at 1 byte plus a float32 scale per row, the rest bf16.
    linears = [m for n, m in model.named_modules() if n.startswith("blocks.") and isinstance(m, torch.nn.Linear)]
    fp8_bytes = teacher_bytes - sum(m.weight.numel() * 2 - m.weight.numel() - m.out_features * 4 for m in linears)
    del model, skeleton
    probes = {
        kind: subprocess.Popen(
            [sys.executable, "-c", RSS_PROBE, kind, str(tmp_path / "t")], stdout=subprocess.PIPE, text=True, cwd=ROOT
        )  # fmt: skip
        for kind in ("bf16", "fp8")
    }
    grown = {kind: int(p.communicate(timeout=120)[0].split()[-1]) for kind, p in probes.items()}
    assert grown["bf16"] > 0.9 * teacher_bytes  # the probe sees the teacher
    assert 0.4 < grown["fp8"] / grown["bf16"], grown
    # ~half: the fp8 bytes plus what the allocator keeps of the per-layer quantization temporaries (fixed, about
    # 20 MiB here, measured 0.58-0.64 of bf16 at this 0.18 GB size; nothing next to a 14B expert's 14 GB)
    assert grown["fp8"] < fp8_bytes + 32 * 2**20, (grown, fp8_bytes)


def test_the_planner_counts_fp8_bytes_and_auto_says_when_only_fp8_fits(make_cfg):
    outside, block = memory.block_bytes(WAN_14B, 2)
    _, fp8_block = memory.block_bytes(WAN_14B, 2, fp8=True)
    assert 0.49 < fp8_block / block < 0.51  # linear weights halve; norms, modulation and biases stay
    kept = [memory.resident_blocks(WAN_14B, 1, torch.bfloat16, 24 * memory.GiB, fp8) for fp8 in (False, True)]
    assert kept[1] >= 2 * kept[0] > 0  # a streamed fp8 teacher keeps twice the blocks on the same GPU
    frame = ["data.latent_height=60", "data.latent_width=104", "student=small", "precision=bf16"]
    hw = ["hardware.gpus=1", "hardware.gpu_memory_gib=32", "hardware.host_memory_gib=64", "teacher_placement=auto"]
    cfg = make_cfg("teacher=wan2.1_t2v_14b", *frame, *hw)
    assert choose(cfg)[0].name != "gpu"  # bf16: 28.6 GB of weights and the training beside them do not fit
    cfg = make_cfg("teacher=wan2.1_t2v_14b", "teacher.quantize=fp8", *frame, *hw)
    placement, table = choose(cfg)
    assert placement.name == "gpu" and "fits in fp8 only: bf16 would not" in table
    w, _ = workload(cfg)
    assert w.teacher_fp8 and memory.teacher_weight_bytes(w) == outside + 40 * fp8_block
    rows = {line.split()[0]: line for line in table.splitlines()[3:]}
    assert "cannot load an fp8 teacher" in rows["sharded"] and "cannot load" in rows["balanced"]
    assert "fp8 weights" in rows["cpu"] and "fp8 weights" not in rows["gpu0"]  # (gpu0: refused for its GPUs)


def test_fp8_is_refused_in_one_line_where_it_cannot_run(make_cfg, tmp_path):
    with pytest.raises(UserError, match=r"teacher.quantize=fp8 cannot run with teacher_placement=sharded; use one "
                                        r"of gpu, gpu0, offload, disk, cpu, or drop teacher.quantize"):  # fmt: skip
        run(make_cfg("teacher.quantize=fp8", "precision=bf16", "teacher_placement=sharded",
                     "distributed.nproc_per_node=2", run_dir=tmp_path / "r"))  # fmt: skip
    assert not (tmp_path / "r").exists()


@pytest.fixture(scope="module", autouse=True)  # autouse: it starts with the module, beside its in-process tests
def clis(request, tmp_path_factory, cache_dir):
    """This module's command-line run (a fresh process), started with the module."""
    args = cli("teacher.quantize=fp8", "precision=fp32", f"paths.cache_dir={cache_dir}", "logger=none",
               f"hydra.run.dir={tmp_path_factory.mktemp('cli') / 'r'}")  # fmt: skip
    return fresh_runs(request, {"fp32": ("test_the_command_line_refuses_fp8_with_an_fp32_teacher_in_one_line", args)})


@pytest.mark.slow  # a fresh process; tests/teacher/test_fastpaths.py refuses the same in-process in the default lane
def test_the_command_line_refuses_fp8_with_an_fp32_teacher_in_one_line(clis):
    result = clis["fp32"].result()
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert lines == [lines[0]] and "use precision=bf16" in lines[0], result.stderr
