"""wandistiller/recipe/hooks/profile.py: a tiny run profiled for a window of its steps writes a trace Perfetto opens,
the ops table and one line; a window the run cannot reach is refused before any work."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from wandistiller.core.errors import UserError
from wandistiller.recipe.hooks.base import HookParts
from wandistiller.recipe.hooks.profile import StepProfile
from wandistiller.train import run


def test_a_profiled_run_writes_its_window_s_trace_ops_and_one_line(make_cfg, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="wandistiller")
    cfg = make_cfg(
        "trainer.max_steps=5", "hooks=[progress,profile]", "hooks.profile.after=1", "hooks.profile.steps=2",
        run_dir=tmp_path / "r",
    )  # fmt: skip
    summary = run(cfg)
    trace = json.loads((tmp_path / "r" / "profile" / "trace.json").read_text())
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    assert "aten::" in (tmp_path / "r" / "profile" / "ops.txt").read_text()
    assert summary["profile_steps"] == 2 and summary["profile_ms_per_step"] > 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("profile:")]
    assert len(lines) == 1 and lines[0].startswith("profile: steps 2-3: ")


def test_a_run_that_ends_inside_the_window_writes_what_it_profiled(tmp_path):
    hook = StepProfile(after=1, steps=10, rows=5)
    ctx = SimpleNamespace(trainer_cfg=OmegaConf.create({"max_steps": 3}), run_dir=tmp_path, device=torch.device("cpu"))
    hook.bind(ctx, HookParts())
    for step in (1, 2, 3):
        hook(None, step)
        torch.ones(64, 64) @ torch.ones(64, 64)
    figures = hook.at_end(None)
    assert figures["profile_steps"] == 2 and (tmp_path / "profile" / "ops.txt").is_file()


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        (
            dict(after=5),
            "hooks.profile.after=5 leaves no step to profile in trainer.max_steps=5; give "
            "hooks.profile.after=4 or less",
        ),
        (dict(after=0), "hooks.profile.after=0 must be at least 1"),
        (dict(steps=0), "hooks.profile.steps=0 must be at least 1"),
    ],
)
def test_a_window_the_run_cannot_profile_is_one_line(settings, says):
    with pytest.raises(UserError) as refused:
        hook = StepProfile(**({"after": 2, "steps": 3, "rows": 40} | settings))
        hook.check(OmegaConf.create({"trainer": {"max_steps": 5}}))
    assert str(refused.value) == says
