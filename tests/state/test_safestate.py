"""wandistiller/state/safestate.py: a nested training state (optimizer, scheduler, scaler, EMA, RNGs) as JSON plus
a safetensors file, round-tripped exactly through the real classes and refused when the files are not its own."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from diffusers.training_utils import EMAModel

from tests.state.test_checkpoint import real_state
from wandistiller.state.checkpoint import load_checkpoint, save_checkpoint


@pytest.mark.parametrize("bf16", [False, True])
def test_a_saved_state_comes_back_equal_with_the_rngs(tmp_path, bf16):
    model, state = real_state(bf16)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    path = save_checkpoint(tmp_path, 3, state, keep=2)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    loaded = load_checkpoint(path)
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    assert loaded["step"] == 3 and loaded["tracker_run_id"] == "abc123"
    for key, value in state["student"].items():
        assert torch.equal(loaded["student"][key], value) and loaded["student"][key].dtype == value.dtype
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    for i, s in state["optimizer"]["state"].items():
        assert all(torch.equal(loaded["optimizer"]["state"][i][k], v) for k, v in s.items())
    assert loaded["lr_scheduler"] == state["lr_scheduler"] and loaded["scaler"] == state["scaler"]
    assert all(torch.equal(a, b) for a, b in zip(loaded["ema"]["shadow_params"], state["ema"]["shadow_params"]))
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(loaded["optimizer"])  # the real classes take it back
    EMAModel(list(model.parameters())).load_state_dict(loaded["ema"])
    assert sorted(p.name for p in path.iterdir()) == ["state.json", "tensors.safetensors"]
