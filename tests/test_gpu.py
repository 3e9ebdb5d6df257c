"""The GPU lane: what only a CUDA machine can check (skipped elsewhere). Tiny models, seconds each."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import BF16, metrics_steps
from wandistiller.core.distributed import Topology
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.placements.disk import DiskPlacement
from wandistiller.placements.offload import OffloadPlacement
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.train import run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TEACHER = OmegaConf.create({"guidance_scale": 4.0, "guidance_scale_2": 3.0})


@pytest.mark.parametrize("placement", [OffloadPlacement(resident_blocks=1), DiskPlacement(resident_blocks=0)])
def test_a_streamed_teacher_on_cuda_gives_the_resident_teachers_targets_bit_for_bit(tiny_moe_path, placement):
    spec = inspect_teacher(tiny_moe_path)
    resident = CpuPlacement().load(spec, TEACHER, BF16, Topology())
    for expert in resident.experts:
        expert.to("cuda")
    resident.device = torch.device("cuda")
    teacher = placement.load(spec, TEACHER, BF16, Topology())
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(4, 16, 1, 8, 8, generator=g), torch.randn(4, 512, 32, generator=g)
    t, uncond = torch.tensor([950.0, 100.0, 880.0, 300.0]), torch.zeros(4, 512, 32)
    for _ in range(3):  # wraps around from the last block to the first between forwards
        got, _ = teacher.targets(x, t, cond, uncond)
        want, _ = resident.targets(x, t, cond, uncond)
        assert torch.equal(got, want)


@pytest.mark.parametrize("overrides", [["teacher_placement=gpu"], ["teacher_placement=gpu", "precision=fp16"],
                                       ["teacher_placement=disk"], ["teacher_placement=offload"]])  # fmt: skip
def test_two_steps_train_on_the_gpu(make_cfg, tmp_path, overrides):
    summary = run(make_cfg(*overrides, "trainer.max_steps=2", run_dir=tmp_path / "r"))
    assert summary["steps_run"] == 2 and summary["device"].startswith("cuda")
    assert all(torch.isfinite(torch.tensor(summary[k])) for k in ("loss_first", "loss_last"))


FP8 = OmegaConf.create({"guidance_scale": 4.0, "guidance_scale_2": 3.0, "quantize": "fp8"})


@pytest.mark.parametrize("placement", [OffloadPlacement(resident_blocks=1), DiskPlacement(resident_blocks=0)])
def test_a_streamed_fp8_teacher_on_cuda_runs_scaled_mm_and_gives_the_resident_fp8_targets(tiny_moe_path, placement):
    from wandistiller.placements.gpu import GpuPlacement
    from wandistiller.teacher.fp8 import relative_mse

    spec = inspect_teacher(tiny_moe_path)
    resident = GpuPlacement().load(spec, FP8, BF16, Topology())
    assert resident.experts[0].blocks[0].attn1.to_q.compute == "scaled_mm"  # the fp8 tensor cores
    teacher = placement.load(spec, FP8, BF16, Topology())
    bf16 = GpuPlacement().load(spec, TEACHER, BF16, Topology())
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(4, 16, 1, 8, 8, generator=g), torch.randn(4, 512, 32, generator=g)
    t, uncond = torch.tensor([950.0, 100.0, 880.0, 300.0]), torch.zeros(4, 512, 32)
    for _ in range(2):
        got, _ = teacher.targets(x, t, cond, uncond)
        assert torch.equal(got, resident.targets(x, t, cond, uncond)[0])
    assert relative_mse(got, bf16.targets(x, t, cond, uncond)[0]) < 0.01


@pytest.mark.parametrize("placement", ["gpu", "offload", "disk"])
def test_two_fp8_steps_train_on_the_gpu_compiled(make_cfg, tmp_path, placement):
    cfg = make_cfg(f"teacher_placement={placement}", "teacher.quantize=fp8", "precision=bf16", "teacher.compile=true",
                   "trainer.max_steps=2", run_dir=tmp_path / "r")  # fmt: skip
    summary = run(cfg)
    assert summary["steps_run"] == 2 and torch.isfinite(torch.tensor(summary["loss_last"]))


# A K=2 student with two fake-score updates per step, batch 2, every step logged (tests/recipe/methods/test_dmd.py's).
DMD_FAST = ["method=dmd", "method.steps=2", "method.fake_updates=2", "trainer.batch_size=2", "trainer.log_every=1"]
DMD_KEYS = ("loss", "loss_dmd", "loss_fake_score", "grad_norm")


def dmd_curve(make_cfg, run_dir, *overrides: str) -> torch.Tensor:
    """A 3-step dmd run's logged curves: [step, DMD_KEYS]."""
    summary = run(make_cfg(*DMD_FAST, "trainer.max_steps=3", *overrides, run_dir=run_dir))
    assert summary["steps_run"] == 3
    rows = metrics_steps(run_dir)
    assert len(rows) == 3
    return torch.tensor([[r[k] for k in DMD_KEYS] for r in rows], dtype=torch.float64)


def test_dmd_under_offload_trains_as_under_gpu(make_cfg, tmp_path):
    # offload streams the teacher's blocks it does not keep (one kept: both paths run) and gives the resident
    # teacher's targets bit for bit (above); the student, its generations and the fake score are the same, so the
    # two runs' loss curves agree to float32 rounding (the tolerance of test_dmd.py's served-teacher comparison).
    resident = dmd_curve(make_cfg, tmp_path / "gpu", "teacher_placement=gpu")
    streamed = dmd_curve(make_cfg, tmp_path / "offload", "teacher_placement=offload",
                         "teacher_placement.resident_blocks=1")  # fmt: skip
    assert torch.isfinite(resident).all() and (resident[:, 1:3] > 0).all()  # dmd and fake-score losses
    assert torch.allclose(streamed, resident, rtol=1e-4, atol=1e-6), (streamed, resident)


@pytest.mark.parametrize("placement", [OffloadPlacement(resident_blocks=1), DiskPlacement(resident_blocks=0)])
@pytest.mark.parametrize("teacher", ["tiny", "tiny_moe"])
def test_a_loss_and_its_adapter_gradients_through_a_streamed_teacher_on_cuda_are_the_resident_ones(
    tiny_path, tiny_moe_path, placement, teacher
):
    # Each block streamed in again in backward (reverse order, prefetched on the side stream) and recomputed: the
    # loss and every adapter's gradient equal the resident teacher's bit for bit, as on the CPU
    # (tests/placements/test_streaming.py). Attention in the math kernel: flash attention's backward is not
    # deterministic, even resident against itself.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tests.placements.test_streaming import adapted_loss_and_grads

    spec = inspect_teacher(tiny_moe_path if teacher == "tiny_moe" else tiny_path)
    resident = CpuPlacement().load(spec, TEACHER, BF16, Topology())
    for expert in resident.experts:
        expert.to("cuda")
    resident.device = torch.device("cuda")
    streamed = placement.load(spec, TEACHER, BF16, Topology())
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(4, 16, 1, 8, 8, generator=g).cuda(), torch.randn(4, 512, 32, generator=g).cuda()
    t, uncond = torch.tensor([950.0, 100.0, 880.0, 300.0]).cuda(), torch.zeros(4, 512, 32).cuda()
    with sdpa_kernel(SDPBackend.MATH):
        for _ in range(2):
            want_loss, want = adapted_loss_and_grads(resident, x, t, cond)
            got_loss, got = adapted_loss_and_grads(streamed, x, t, cond)
            assert torch.equal(got_loss, want_loss) and want_loss > 0
            assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
            with torch.no_grad():  # the teacher's own output after a backward
                assert torch.equal(streamed.targets(x, t, cond, uncond)[0], resident.targets(x, t, cond, uncond)[0])
