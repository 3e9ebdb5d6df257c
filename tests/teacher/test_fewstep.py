"""`wandistiller.teacher.fewstep`: a few-step student's schedule, and that it survives a scheduler's save and load
(what a few-step student's `pipeline/` relies on)."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from wandistiller.teacher.fewstep import few_step_scheduler, student_schedule
from wandistiller.teacher.spec import inspect_teacher


def test_k_points_spread_over_the_teachers_shifted_schedule_down_to_clean(tiny_path):
    timesteps, sigmas = student_schedule(inspect_teacher(tiny_path), 4)  # the tiny teacher: shift 3, 1000 steps
    assert sigmas.tolist() == pytest.approx([1.0, 0.9282, 0.7993, 0.5, 0.0], abs=1e-4)  # DMD2's 4 points
    assert timesteps.tolist() == pytest.approx([1000.0, 928.21, 799.28, 500.0], abs=1e-2)
    assert student_schedule(inspect_teacher(tiny_path), 1)[1].tolist() == [1.0, 0.0]  # one jump: noise to clean


def test_a_saved_few_step_scheduler_loads_back_to_the_same_timesteps(tiny_path, tmp_path):
    spec = inspect_teacher(tiny_path)
    few_step_scheduler(spec, 3).save_pretrained(tmp_path / "scheduler")
    loaded = FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path / "scheduler")
    loaded.set_timesteps(3)
    assert torch.equal(loaded.timesteps.float(), student_schedule(spec, 3)[0])


def test_a_schedule_has_one_step_at_least(tiny_path):
    with pytest.raises(ValueError, match="at least one step, not 0"):
        student_schedule(inspect_teacher(tiny_path), 0)
