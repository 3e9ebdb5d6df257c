"""Tests of wandistiller/placements/base.py, what every placement shares: `load_teacher` on the tiny teachers (frozen,
in the asked dtype, quantized as read with fp8), the defaults a placement inherits, the fp8 refusal from its flag."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import BF16
from tests.placements.test_memory import machine, tiny_workload
from wandistiller.core.distributed import World
from wandistiller.core.errors import UserError
from wandistiller.placements.base import Placement, check_quantize_placement, load_teacher
from wandistiller.placements.memory import Estimate
from wandistiller.teacher.spec import inspect_teacher


def scales(scale: float, scale_2: float | None):
    return OmegaConf.create({"guidance_scale": scale, "guidance_scale_2": scale_2, "quantize": None})


def test_load_teacher_gives_every_expert_frozen_in_the_asked_dtype_on_the_device(tiny_moe_path):
    teacher = load_teacher(inspect_teacher(tiny_moe_path), scales(4.0, 2.0), torch.bfloat16, torch.device("cpu"))
    assert len(teacher.experts) == 2 and teacher.guidance_scales == [4.0, 2.0]
    for expert in teacher.experts:
        assert not expert.training and not any(p.requires_grad for p in expert.parameters())
        assert expert.proj_out.weight.dtype == torch.bfloat16 and expert.proj_out.weight.device.type == "cpu"
        assert expert.blocks[0].scale_shift_table.dtype == torch.float32  # kept in fp32 by diffusers


def test_load_teacher_with_fp8_quantizes_the_blocks_as_it_reads_them(tiny_path):
    from wandistiller.teacher.fp8 import is_quantized

    fp8 = scales(4.0, None)
    fp8.quantize = "fp8"
    teacher = load_teacher(inspect_teacher(tiny_path), fp8, torch.bfloat16, torch.device("cpu"))
    plain = load_teacher(inspect_teacher(tiny_path), scales(4.0, None), torch.bfloat16, torch.device("cpu"))
    assert is_quantized(teacher.experts[0]) and not is_quantized(plain.experts[0])


class Minimal(Placement):
    """A placement that writes only what it must: it inherits every default."""

    name, speed_rank = "minimal", 42

    def estimate(self, w, hw):
        return Estimate.of(self.name, (), 1, hw, "")

    def teacher_device(self, topology):
        return torch.device("cpu")

    def load(self, spec, teacher_cfg, precision, topology):
        raise NotImplementedError


def test_a_placement_by_default_checks_nothing_ranks_by_its_speed_rank_and_takes_nothing_from_a_plan():
    placement = Minimal()
    placement.check(BF16, World(nproc_per_node=1, nnodes=1))
    assert placement.speed(machine(0)) == placement.speed(machine(8)) == 42
    plan = placement.estimate(tiny_workload(), machine(0))
    placement.with_plan(plan)
    assert vars(placement) == {} and Minimal.default_ranks() == 1


def test_a_placement_that_cannot_load_an_fp8_teacher_is_refused_naming_those_that_can():
    from wandistiller.placements.cpu import CpuPlacement
    from wandistiller.placements.sharded import ShardedPlacement

    check_quantize_placement("fp8", CpuPlacement())
    check_quantize_placement(None, ShardedPlacement())
    with pytest.raises(UserError, match=r"teacher.quantize=fp8 cannot run with teacher_placement=sharded; use .*cpu"):
        check_quantize_placement("fp8", ShardedPlacement())


def test_a_fine_tuned_teacher_streamed_or_quantized_as_read_is_the_merged_teacher(tiny_path, tmp_path):
    """teacher.lora where the weights are read from the teacher's files as they are used: the disk placement's
    streamed blocks (offload's packed copy reads the same way) give the resident merged teacher's targets, and an fp8
    teacher quantized as read holds the merged weights quantized (the LoRA merged in float32 before quantizing)."""
    from safetensors.torch import save_file

    from tests.conftest import FP32
    from tests.teacher.test_finetune import peft_state
    from wandistiller.core.distributed import Topology
    from wandistiller.placements.cpu import CpuPlacement
    from wandistiller.placements.disk import DiskPlacement
    from wandistiller.placements.streaming import load_fp8_expert
    from wandistiller.teacher.finetune import patch_of, with_loras
    from wandistiller.teacher.model import save_finetuned_expert

    plain = inspect_teacher(tiny_path)
    save_file(peft_state(plain.transformer_config), tmp_path / "style.safetensors")
    tuned = with_loras(plain, [{"path": str(tmp_path / "style.safetensors"), "strength": 0.7}])
    cfg = scales(4.0, None)
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 16, 1, 8, 8, generator=g), torch.tensor([900.0, 200.0])
    cond, uncond = torch.randn(2, 7, 32, generator=g), torch.randn(2, 7, 32, generator=g)
    resident = CpuPlacement().load(tuned, cfg, FP32, Topology()).targets(x, t, cond, uncond)[0]
    streamed = DiskPlacement(resident_blocks=0).load(tuned, cfg, FP32, Topology()).targets(x, t, cond, uncond)[0]
    before = CpuPlacement().load(plain, cfg, FP32, Topology()).targets(x, t, cond, uncond)[0]
    assert not torch.allclose(before, resident, atol=1e-3)
    torch.testing.assert_close(streamed, resident, atol=1e-6, rtol=1e-5)
    save_finetuned_expert(tuned, "transformer", tmp_path / "merged")  # the fine-tuned expert, in float32
    quantized = load_fp8_expert(
        tiny_path / "transformer", torch.bfloat16, torch.device("cpu"), patch_of(tuned.loras, "transformer")
    )
    expected = load_fp8_expert(tmp_path / "merged", torch.bfloat16, torch.device("cpu"))
    for (name, ours), theirs in zip(quantized.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(ours, theirs), name


def test_load_teacher_merges_the_specs_loras_into_every_expert_they_go_on(tiny_moe_path, tmp_path):
    from safetensors.torch import save_file

    from tests.teacher.test_finetune import peft_state
    from wandistiller.teacher.finetune import with_loras

    plain = inspect_teacher(tiny_moe_path)
    save_file(peft_state(plain.transformer_config), tmp_path / "low.safetensors")
    tuned = with_loras(plain, [{"path": str(tmp_path / "low.safetensors"), "expert": "transformer_2"}])
    before = load_teacher(plain, scales(4.0, None), torch.float32, torch.device("cpu"))
    after = load_teacher(tuned, scales(4.0, None), torch.float32, torch.device("cpu"))
    name = "blocks.0.attn1.to_q.weight"
    high, low = (dict(e.named_parameters()) for e in after.experts)
    assert torch.equal(high[name], dict(before.experts[0].named_parameters())[name])  # not its expert
    assert not torch.equal(low[name], dict(before.experts[1].named_parameters())[name])
    assert not low[name].requires_grad and not after.experts[1].training  # still the frozen teacher
