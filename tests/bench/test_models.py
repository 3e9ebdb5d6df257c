"""Tests wandistiller/bench/models.py, what the benchmarks share: the FLOP count, an architecture's full config,
seeded forward inputs, the timing loop and the /proc memory reader, on tiny shapes in-process; the random-weight
model builder (2**27 seeded values) in the slow lane."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from wandistiller.bench.models import (
    ARCHS,
    forward_flops,
    forward_inputs,
    memory_gib,
    model_config,
    pinned_bandwidth,
    pool_size,
    random_model,
    time_forward,
)


def test_forward_flops_count_projections_attention_and_ffn_per_layer_and_sample():
    config = {"num_attention_heads": 2, "attention_head_dim": 3, "ffn_dim": 10, "num_layers": 4}
    d, f, tokens, text = 6, 10, 5, 7  # width = heads x head dim
    per_layer = 12 * tokens * d * d + 4 * text * d * d + 4 * tokens * tokens * d + 4 * tokens * text * d
    per_layer += 4 * tokens * d * f
    assert forward_flops(config, 1, tokens, text) == 4 * per_layer
    assert forward_flops(config, 3, tokens, text) == 3 * forward_flops(config, 1, tokens, text)
    assert forward_flops(config, 1, tokens) == forward_flops(config, 1, tokens, 512)  # Wan's 512 text tokens


def test_an_architectures_config_is_its_numbers_with_diffusers_defaults_filled_in():
    config = model_config("tiny")
    assert {k: config[k] for k in ARCHS["tiny"]} == ARCHS["tiny"]
    assert config["in_channels"] == 16 and tuple(config["patch_size"]) == (1, 2, 2)
    assert set(ARCHS) == {"tiny", "1.3b", "14b"}


def test_forward_inputs_are_seeded_by_the_batch_and_shaped_for_the_model():
    args = SimpleNamespace(latent_height=4, latent_width=6)
    config = {"text_dim": 32}
    two = forward_inputs(2, args, config, torch.device("cpu"), torch.bfloat16)
    assert two["hidden_states"].shape == (2, 16, 1, 4, 6) and two["hidden_states"].dtype == torch.bfloat16
    assert two["encoder_hidden_states"].shape == (2, 512, 32) and two["return_dict"] is False
    assert two["timestep"].shape == (2,) and 0 <= two["timestep"].min() and two["timestep"].max() < 1000
    again = forward_inputs(2, args, config, torch.device("cpu"), torch.bfloat16)
    assert torch.equal(two["hidden_states"], again["hidden_states"])  # the same inputs for resident and streamed
    other = forward_inputs(3, args, config, torch.device("cpu"), torch.bfloat16)["hidden_states"][:2]
    assert not torch.equal(other, two["hidden_states"]) and two["hidden_states"].abs().sum() > 0


def test_time_forward_warms_up_twice_then_returns_the_median_of_its_repetitions():
    calls, sleeps = [], iter([0, 0, 0.2, 0.01, 0])  # two warm-ups, then 0.2 s, 0.01 s, 0 s

    def model(**inputs):
        calls.append(inputs["x"])
        time.sleep(next(sleeps))

    seconds = time_forward(model, {"x": 1}, torch.device("cpu"), reps=3)
    assert calls == [1] * 5 and 0.009 < seconds < 0.06  # the median; the mean would be 0.07, the last 0


def test_memory_is_read_from_proc_in_gib_and_the_peak_is_at_least_the_current():
    memory = memory_gib()
    assert set(memory) == {"VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"}
    assert 0 < memory["VmRSS"] <= memory["VmHWM"] < 1024
    assert pinned_bandwidth(torch.device("cpu")) is None  # no host->device copy to measure


def test_the_random_pool_holds_the_widest_weight_of_a_14b_expert():
    """A 14B expert's FFN weight (30720 x 5120) is larger than 2**27: a pool of 2**27 failed on the H100."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    with init_empty_weights():
        expert = WanTransformer3DModel(**(ARCHS["14b"] | {"num_layers": 1}))
    widest = max(p.numel() for p in expert.parameters())
    assert widest > 2**27 and pool_size(expert) == widest
    with init_empty_weights():
        assert pool_size(WanTransformer3DModel(**ARCHS["tiny"])) == 2**27  # small models draw the same values as ever


@pytest.mark.slow  # draws 2**27 seeded values twice: 4 to 16 s on 2 cores
def test_a_random_model_is_the_same_every_call_never_zero_and_scaled_like_an_init():
    model = random_model("tiny", torch.float32)
    assert dict(model.config)["num_layers"] == ARCHS["tiny"]["num_layers"] and not model.training
    weights = torch.cat([p.flatten() for p in model.parameters()])
    assert not any(p.requires_grad for p in model.parameters()) and (weights != 0).all()
    assert 0.015 < weights.std().item() < 0.025
    again = random_model("tiny", torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
