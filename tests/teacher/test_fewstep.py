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


# ComfyUI's own `simple_scheduler` / `beta_scheduler` (comfy/samplers.py) on ModelSamplingDiscreteFlow at each shift,
# copied verbatim (its current form) into a scratch folder outside this repository, run there, printed to 7
# decimals and pinned here.
COMFY = {
    ("simple", 3.0, 4): [1.0, 0.9, 0.75, 0.5, 0.0],
    ("simple", 3.0, 8): [1.0, 0.9545454, 0.9, 0.8333333, 0.75, 0.6428571, 0.5, 0.3, 0.0],
    ("simple", 5.0, 4): [1.0, 0.9375, 0.8333333, 0.625, 0.0],
    ("simple", 8.0, 8): [1.0, 0.9824561, 0.96, 0.9302326, 0.8888889, 0.8275862, 0.7272727, 0.5333334, 0.0],
    ("beta", 3.0, 2): [1.0, 0.7507493, 0.0],
    ("beta", 3.0, 3): [1.0, 0.8877552, 0.5335051, 0.0],
    ("beta", 3.0, 4): [1.0, 0.9335348, 0.7507493, 0.3921714, 0.0],
    ("beta", 5.0, 4): [1.0, 0.9590316, 0.8338881, 0.5181499, 0.0],
    ("beta", 8.0, 8): [1.0, 0.992501, 0.9739953, 0.9422503, 0.8892833, 0.797583, 0.6324252, 0.3300142, 0.0],
}


@pytest.mark.parametrize("name,shift,steps", sorted(COMFY))
def test_comfyuis_simple_and_beta_sigmas_are_its_own_functions_values(name, shift, steps):
    from wandistiller.teacher.fewstep import Schedule

    spec = TeacherSpec(Path("."), ("transformer",), {}, None, flow_shift=shift, num_train_timesteps=1000)
    timesteps, sigmas = student_schedule(spec, steps, Schedule(name))
    assert sigmas.tolist() == pytest.approx(COMFY[name, shift, steps], abs=1e-6)
    assert torch.allclose(timesteps, sigmas[:-1] * 1000)  # ComfyUI's ModelSamplingDiscreteFlow.timestep: sigma x 1000
    # method.shift overrides the teacher's: the same sigmas from a teacher at another shift
    other = TeacherSpec(Path("."), ("transformer",), {}, None, flow_shift=1.0, num_train_timesteps=1000)
    assert student_schedule(other, steps, Schedule(name, shift))[1].tolist() == pytest.approx(sigmas.tolist())


@pytest.mark.parametrize("schedule", ["simple", "beta", [1.0, 0.8, 0.6, 0.3]])
def test_the_schedulers_set_timesteps_walks_the_schedules_sigmas_exactly(schedule):
    from wandistiller.teacher.fewstep import parse_schedule

    parsed = parse_schedule(schedule, None, 4)
    scheduler = few_step_scheduler(SPEC, 4, parsed)
    scheduler.set_timesteps(4)  # what WanPipeline calls
    assert torch.allclose(scheduler.sigmas.float(), student_schedule(SPEC, 4, parsed)[1], atol=1e-7)
    assert torch.allclose(scheduler.timesteps.float(), student_schedule(SPEC, 4, parsed)[0], atol=1e-4)


@pytest.mark.parametrize(
    "value,shift,message",
    [
        ([1.0, 0.9, 0.75], None, "method.schedule=[1,0.9,0.75] has 3 sigmas and method.steps=4; give one sigma per"),
        ([1.0, 0.75, 0.9, 0.5], None, "method.schedule=[1,0.75,0.9,0.5]: the sigmas must decrease strictly"),
        ([1.5, 0.9, 0.75, 0.5], None, "method.schedule=[1.5,0.9,0.75,0.5]: every sigma must lie in (0, 1]"),
        ([1.0, 0.9, 0.75, 0.0], None, "method.schedule=[1,0.9,0.75,0]: every sigma must lie in (0, 1]"),
        ("karras", None, "method.schedule=karras is not one of euler, simple, beta or a list"),
        ("simple", -1.0, "method.shift=-1.0 must be a positive number"),
        ([1.0, 0.9, 0.75, 0.5], 5.0, "method.shift=5 is for method.schedule=simple or beta; drop it with a list"),
    ],
)
def test_a_bad_schedule_is_one_line_naming_the_key_and_the_fix(value, shift, message):
    from wandistiller.core.errors import UserError
    from wandistiller.teacher.fewstep import parse_schedule

    with pytest.raises(UserError) as e:
        parse_schedule(value, shift, 4)
    assert str(e.value).startswith(message) and "\n" not in str(e.value) and "; " in str(e.value)
