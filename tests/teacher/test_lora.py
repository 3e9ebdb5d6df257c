"""wandistiller/teacher/lora.py: adapters on a Wan transformer's attention projections and FFN Linears, on only
inside `active()` (an error included), starting at zero (the teacher exactly), saving the adapters alone, and
computing in the teacher's dtype from fp32 adapters."""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel

from wandistiller.core.arch import TINY_TRANSFORMER
from wandistiller.teacher.lora import TARGETS, Adapters, adapter_count, targets
from wandistiller.teacher.model import freeze


def _wan(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return freeze(WanTransformer3DModel.from_config(TINY_TRANSFORMER).to(dtype))


def _call(model, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x, cond = torch.randn(2, 16, 1, 8, 8, generator=g), torch.randn(2, 8, 32, generator=g)
    return model(x.to(dtype), torch.tensor([900.0, 100.0]), cond.to(dtype), return_dict=False)[0]


def test_every_blocks_attention_projections_and_ffn_linears_are_adapted():
    model = _wan()
    found = [name for name, _ in targets(model)]
    assert len(found) == TINY_TRANSFORMER["num_layers"] * len(TARGETS) == 40
    assert found[:3] == ["blocks.0.attn1.to_q", "blocks.0.attn1.to_k", "blocks.0.attn1.to_v"]
    assert "blocks.3.attn2.to_out.0" in found and "blocks.3.ffn.net.2" in found
    adapters = Adapters(model, 4)
    assert sum(p.numel() for p in adapters.parameters()) == adapter_count(model, 4) == 4 * 4 * (16 * 32 + 2 * 96)
    assert set(adapters.state_dict()) == {f"{side}.{n.replace('.', '_')}" for side in ("down", "up") for n in found}
    with pytest.raises(ValueError, match="no Linear layer to adapt"):
        Adapters(torch.nn.Sequential(torch.nn.Linear(2, 2)), 4)


def test_adapters_start_at_the_teacher_and_act_only_inside_active():
    model = _wan()
    adapters = Adapters(model, 4)
    with torch.no_grad():
        before = _call(model)
        with adapters.active():
            assert torch.equal(_call(model), before)  # B = 0
        for p in adapters.up.values():
            p.fill_(0.01)
        with adapters.active():
            adapted = _call(model)
        assert not torch.allclose(adapted, before) and torch.equal(_call(model), before)
        with pytest.raises(RuntimeError), adapters.active():
            raise RuntimeError("a failed call")
        assert not adapters.on and torch.equal(_call(model), before)  # off again after the error


def test_fp32_adapters_on_a_bf16_teacher_compute_in_its_dtype_and_take_its_gradient():
    model = _wan(torch.bfloat16)
    adapters = Adapters(model, 2)  # fp32, the student's master dtype
    with adapters.active():
        out = _call(model, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in adapters.up.values())
    assert all(p.grad is None for p in model.parameters())
