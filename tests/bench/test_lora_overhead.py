"""Tests wandistiller/bench/lora_overhead.py: the hand-written LoRA step computes what the framework's LoRA student
computes (the same prediction, loss and adapter gradients), so the ratio the bench prints compares like with like;
on the session's tiny teacher, one step of each."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from wandistiller.bench.lora_overhead import hand_models, lora_overhead
from wandistiller.teacher.lora import Adapters


def test_the_hand_written_adapted_model_predicts_what_the_adapted_teacher_does(tiny_path):
    from diffusers import WanTransformer3DModel

    expert = WanTransformer3DModel.from_pretrained(tiny_path, subfolder="transformer").eval().requires_grad_(False)
    adapters = Adapters(expert, rank=4, alpha=8.0)
    with torch.no_grad():
        for p in adapters.up.values():  # B off zero: the adapters change the output
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    plain, adapted, params = hand_models(expert, adapters)
    assert len(params) == 2 * len(adapters.layers) and all(p.requires_grad for p in params)
    # The frozen weights are the expert's own tensors, not a copy: both sides read the same memory.
    assert {id(p) for p in adapted.parameters()} - {id(p) for p in params} == {id(p) for p in expert.parameters()}
    assert {id(p) for p in plain.parameters()} == {id(p) for p in expert.parameters()}
    # and neither carries the framework's hooks: the hand-written side pays for none
    assert not any(m._forward_hooks for m in [*plain.modules(), *adapted.modules()])
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(1, 16, 1, 4, 4, generator=g), torch.tensor([500.0])
    text = torch.randn(1, 8, expert.config.text_dim, generator=g)
    kwargs = {"hidden_states": x, "timestep": t, "encoder_hidden_states": text, "return_dict": False}
    with torch.no_grad():
        plain_out = expert(**kwargs)[0]
        with adapters.active():
            hooked = expert(**kwargs)[0]
        hand, hand_plain = adapted(**kwargs)[0], plain(**kwargs)[0]
    assert torch.equal(hand, hooked) and torch.equal(hand_plain, plain_out) and not torch.equal(hand, plain_out)


def test_the_bench_checks_both_first_steps_agree_then_reports_the_ratio(cache_dir, tiny_path, capsys):
    result = lora_overhead(SimpleNamespace(cache_dir=str(cache_dir), batch_size=1, steps=1, reps=1))
    check = result["first_step"]
    assert check["framework_loss"] == check["handwritten_loss"]
    assert check["grad_max_abs"] > 0 and check["grad_max_abs_diff"] <= 1e-6 * check["grad_max_abs"]
    assert (result["student"], result["method"], result["batch_size"]) == ("lora", "kd", 1)
    assert result["ratio"] == result["framework_ms_per_step"] / result["handwritten_ms_per_step"] > 0
    assert result["cpu_ratio"] == result["framework_cpu_ms_per_step"] / result["handwritten_cpu_ms_per_step"] > 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("first step: loss") and out[-1] == f"ratio {result['ratio']:.3f}x (target <= 1.10x)"
