"""A few-step student's own schedule: the one contract between training (`method=trajectory|dmd`, which
learn to jump between its points) and sampling (`eval`, `generate`, the saved pipeline, which walk them).

The schedule is diffusers' FlowMatchEulerDiscreteScheduler at the teacher's flow shift and train timesteps,
set to K steps: K timesteps from pure noise down, and K + 1 sigmas ending at 0 (the clean sample). Its
`shift_terminal` is the shifted sigma of t = 1/K, so the K points are spread over the whole schedule as
DMD2's are (shift 3, K=4: sigmas 1, .93, .80, .50, 0); without it the last step would start at sigma 0.009 and
waste a network call. Saving that scheduler in a student's pipeline is what lets
`WanPipeline(...)(prompt, num_inference_steps=K)` sample on the student's own timesteps, with no code of ours.
It is K's alone: set to another count n, diffusers stretches the schedule to end at K's last point, and at n = 1
the stretch divides by zero (NaN sigmas). Sampling at n is `few_step_scheduler(spec, n)` (eval and generate
`--student-steps n`; the model card writes the same rebuild with diffusers alone: state/export.py `other_steps`).
"""

from __future__ import annotations

import torch

from wandistiller.teacher.spec import TeacherSpec


def few_step_scheduler(spec: TeacherSpec, steps: int):
    """The K-step student's Euler flow-matching scheduler on the teacher's schedule (call `set_timesteps(K)`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    shift = spec.flow_shift
    terminal = {"shift_terminal": shift / steps / (1 + (shift - 1) / steps)} if steps > 1 else {}
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=spec.num_train_timesteps, shift=shift, **terminal)


def student_schedule(spec: TeacherSpec, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps [K], sigmas [K + 1]) of a K-step student: x at sigma_i, the student's velocity v at
    timesteps[i], gives x + (sigma_{i+1} - sigma_i) v at sigma_{i+1}; sigmas[-1] is 0."""
    if steps < 1:
        raise ValueError(f"a few-step schedule has at least one step, not {steps}")
    scheduler = few_step_scheduler(spec, steps)
    scheduler.set_timesteps(steps)
    return scheduler.timesteps.float().clone(), scheduler.sigmas.float().clone()
