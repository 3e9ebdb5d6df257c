"""`wandistiller.teacher.fewstep`: a K-step student's schedule spans the teacher's, and diffusers' own scheduler
(what a saved pipeline loads) walks exactly it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wandistiller.teacher.fewstep import few_step_scheduler, student_schedule
from wandistiller.teacher.spec import TeacherSpec

SPEC = TeacherSpec(Path("."), ("transformer",), {}, None, flow_shift=3.0, num_train_timesteps=1000)


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 8])
def test_k_points_from_pure_noise_to_clean_spread_over_the_whole_schedule(steps):
    timesteps, sigmas = student_schedule(SPEC, steps)
    assert timesteps.shape == (steps,) and sigmas.shape == (steps + 1,)
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0 and bool((sigmas[:-1] > sigmas[1:]).all())
    assert torch.allclose(timesteps, sigmas[:-1] * 1000)
    # The last step starts at the shifted sigma of t = 1/K (DMD2's spacing), not near 0 where it would do nothing.
    last = SPEC.flow_shift / steps / (1 + (SPEC.flow_shift - 1) / steps) if steps > 1 else 1.0
    assert float(sigmas[-2]) == pytest.approx(last, rel=1e-5)


def test_four_steps_at_shift_3_are_dmd2s_points():
    assert torch.allclose(student_schedule(SPEC, 4)[1], torch.tensor([1.0, 0.9282, 0.7993, 0.5, 0.0]), atol=1e-4)


def test_the_saved_scheduler_gives_the_same_points_after_a_round_trip(tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler

    few_step_scheduler(SPEC, 4).save_pretrained(tmp_path)
    loaded = FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path)
    loaded.set_timesteps(4)
    assert torch.allclose(loaded.sigmas.float(), student_schedule(SPEC, 4)[1])
    with pytest.raises(ValueError, match="at least one step"):
        student_schedule(SPEC, 0)
