"""wandistiller/teacher/lora.py: adapters on a Wan transformer's attention projections and FFN Linears, on only
inside `active()` (an error included), starting at zero (the teacher exactly), saving the adapters alone, and
computing in the teacher's dtype from fp32 adapters."""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel

from wandistiller.core.arch import TINY_TRANSFORMER
from wandistiller.teacher.lora import TARGETS, Adapters, targets
from wandistiller.teacher.model import freeze


def adapter_count(model, rank: int, names=TARGETS) -> int:
    """Trainable parameters of rank-`rank` adapters on `model`, counted from its Linears' widths."""
    return sum(rank * (m.in_features + m.out_features) for _, m in targets(model, names))


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


# -- compiled (teacher.compile=true): one graph per adapter state, shared by every block ------------------------
def _two_sets(model) -> tuple[Adapters, Adapters]:
    """A student's adapters on every target and a fake score's on two, B off zero: each set changes the output."""
    sets = Adapters(model, 4, seed=0), Adapters(model, 2, seed=1, names=("attn1.to_q", "ffn.net.2"))
    with torch.no_grad():
        for k, adapters in enumerate(sets):
            for p in adapters.up.values():
                p.normal_(0, 0.01, generator=torch.Generator().manual_seed(k))
    return sets


def _switched_calls(model, student: Adapters, fake: Adapters) -> dict[str, torch.Tensor]:
    """The teacher (no grad), the student with its gradients, the fake score, the teacher again: one pass of the
    per-call switching a dmd step does."""
    out = {}
    with torch.no_grad():
        out["teacher"] = _call(model)
    with student.active():
        y = _call(model)
        y.square().mean().backward()
    out["student"] = y.detach()
    out["student_grads"] = torch.cat([p.grad.flatten() for p in student.parameters()])  # type: ignore[union-attr]
    student.zero_grad(set_to_none=True)
    with fake.active():
        out["fake"] = _call(model).detach()
    with torch.no_grad():
        out["teacher_again"] = _call(model)
    return out


def _graphs_after_two_passes(model, sets) -> tuple[dict, dict, int, int]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    first = _switched_calls(model, *sets)
    graphs = counters["stats"]["unique_graphs"]
    second = _switched_calls(model, *sets)
    return first, second, graphs, counters["stats"]["unique_graphs"]


def test_compiled_adapted_blocks_share_one_graph_per_adapter_state_and_switching_recompiles_nothing():
    """dynamo's own guards (the eager backend: what decides graphs and recompiles, without inductor's codegen):
    every block of the expert runs the same graph for a state, so 4 blocks and 3 states (teacher, student, fake
    score) make 5 graphs, not 4 per state: the teacher's, and per adapter set one for block 0 (its input needs no
    gradient) and one for the blocks after it (theirs do). A second pass through every switch adds none."""
    from wandistiller.teacher.model import compile_blocks

    model = _wan()
    sets = _two_sets(model)
    eager = _switched_calls(model, *sets)
    compile_blocks(model, backend="eager")
    first, second, graphs, after = _graphs_after_two_passes(model, sets)
    assert graphs == after == 5
    for name, want in eager.items():
        assert torch.allclose(first[name], want, rtol=1e-5, atol=1e-7) and torch.equal(second[name], first[name])
    assert not torch.equal(eager["student"], eager["teacher"]) and not torch.equal(eager["fake"], eager["teacher"])


@pytest.mark.slow  # inductor's C++ codegen of 5 block graphs on the CPU: minutes on 2 cores
def test_regionally_compiled_adapted_blocks_equal_eager_ones_within_the_compile_tolerance():
    """teacher/model.py's compile_blocks (inductor), as teacher.compile=true runs it: the teacher's, the student's
    and the fake score's outputs and the student's gradients within the relative 1e-3 the compiled training run
    keeps to the eager one (tests/test_train.py), and the same 5 graphs for 4 blocks."""
    from wandistiller.teacher.model import compile_blocks

    model = _wan()
    sets = _two_sets(model)
    eager = _switched_calls(model, *sets)
    compile_blocks(model)
    first, second, graphs, after = _graphs_after_two_passes(model, sets)
    assert graphs == after == 5
    for name, want in eager.items():
        for got in (first[name], second[name]):
            assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max()), name


def test_a_block_compiled_and_run_before_its_adapters_exist_sees_them_once_they_do():
    # a teacher that samples (compiled, no adapters yet) before its LoRA student and fake score are made: dynamo does
    # not guard on hooks added after it traced, so compile_blocks hooks every adaptable layer first (make_room)
    from wandistiller.teacher.model import compile_blocks

    model = _wan()
    compile_blocks(model, backend="eager")
    with torch.no_grad():
        before = _call(model)
    student, fake = _two_sets(model)
    with torch.no_grad():
        with student.active():
            adapted = _call(model)
        with fake.active():
            faked = _call(model)
        assert torch.equal(_call(model), before)
    eager = _wan()
    student_eager, fake_eager = _two_sets(eager)
    with torch.no_grad():
        with student_eager.active():
            assert torch.allclose(adapted, _call(eager), rtol=1e-5, atol=1e-7) and not torch.equal(adapted, before)
        with fake_eager.active():
            assert torch.allclose(faked, _call(eager), rtol=1e-5, atol=1e-7) and not torch.equal(faked, before)
