"""wandistiller/recipe/hooks/fault.py: the injected failure read from WANDISTILLER_INJECT_FAILURE, called directly
and in a real run, fails only its rank's step, with a RuntimeError or an out-of-memory error."""

from __future__ import annotations

import pytest
import torch

from wandistiller.recipe.hooks.fault import FaultInjection
from wandistiller.train import run


def test_the_injected_failure_is_a_hook_that_fails_its_step_on_its_rank(make_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDISTILLER_INJECT_FAILURE", "0:2")
    with pytest.raises(RuntimeError, match="injected failure at step 2"):
        run(make_cfg("trainer.max_steps=4", run_dir=tmp_path / "r"))
    monkeypatch.setenv("WANDISTILLER_INJECT_FAILURE", "1:2")  # another rank's: this one runs to the end
    assert run(make_cfg("trainer.max_steps=3", run_dir=tmp_path / "s"))["steps_run"] == 3


def test_the_oom_kind_raises_torchs_out_of_memory_error_at_that_step_only(monkeypatch):
    monkeypatch.setenv(FaultInjection.ENV, "1:3:oom")
    monkeypatch.setenv("RANK", "1")
    hook = FaultInjection()
    assert not hook.main_only  # a failure on a rank other than the main one must fire there
    for finished in (1, 2, 4):
        hook(None, finished)
    with pytest.raises(torch.OutOfMemoryError, match="injected out-of-memory at step 3"):
        hook(None, 3)


def test_another_ranks_failure_never_fires_here(monkeypatch):
    monkeypatch.setenv(FaultInjection.ENV, "1:3")
    monkeypatch.delenv("RANK", raising=False)  # rank 0 when unset
    hook = FaultInjection()
    for finished in range(1, 6):
        hook(None, finished)
    assert hook.step is None and not hook.oom
