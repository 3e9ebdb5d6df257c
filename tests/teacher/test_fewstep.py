"""wandistiller/teacher/fewstep.py: a K-step student's schedule spans the teacher's (shift 3, K=4: sigmas 1, .928,
.799, .5, 0), its timesteps are its first K sigmas on the teacher's train-timestep scale, and K=0 is refused."""

from __future__ import annotations

import pytest
import torch

from wandistiller.teacher.fewstep import student_schedule
from wandistiller.teacher.spec import inspect_teacher


def test_four_steps_spread_over_the_whole_schedule_and_end_at_the_clean_sample(tiny_path):
    spec = inspect_teacher(tiny_path)
    timesteps, sigmas = student_schedule(spec, 4)
    assert len(timesteps) == 4 and len(sigmas) == 5 and sigmas[-1] == 0 and sigmas[0] == 1
    assert torch.allclose(sigmas, torch.tensor([1.0, 0.928, 0.799, 0.5, 0.0]), atol=1e-3)
    assert torch.allclose(timesteps, sigmas[:-1] * spec.num_train_timesteps)
    with pytest.raises(ValueError):
        student_schedule(spec, 0)
