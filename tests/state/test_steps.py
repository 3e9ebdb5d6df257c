"""A student's own step count (issue 28): read from a run's saved config (`method.steps`), carried by its saved
`student/`, `pipeline/` and model card, so diffusers' WanPipeline samples a few-step student on its own timesteps."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import refused
from wandistiller.state import export
from wandistiller.state.runs import open_run, student_scheduler, student_steps
from wandistiller.teacher.fewstep import student_schedule
from wandistiller.teacher.spec import inspect_teacher


@pytest.mark.parametrize(
    ("saved", "steps"),
    [
        ({}, None),  # a config saved before the `method` group: today's KD student
        ({"method": None}, None),
        ({"method": {"name": "kd", "steps": None}}, None),
        ({"method": {"name": "kd"}}, None),
        ({"method": {"name": "trajectory", "steps": 4}}, 4),
        ({"method": {"name": "dmd", "steps": 1}}, 1),
    ],
)
def test_a_students_steps_are_its_configs_method_steps_and_none_for_kd(saved, steps):
    assert student_steps(OmegaConf.create({"seed": 0, **saved})) == steps


@pytest.mark.parametrize("bad", [0, -2, 2.5, "4", True, "${oc.env:HOME}"])
def test_a_saved_step_count_that_is_not_one_is_one_line(bad):
    with refused(f"method.steps={bad!r} in the run's saved config is not a step count"):
        student_steps(OmegaConf.create({"method": {"steps": bad}}))


def test_a_kd_student_samples_with_the_teachers_scheduler_and_a_few_step_one_with_its_own(tiny_path):
    spec = inspect_teacher(tiny_path)
    assert student_scheduler(spec, None, 4) is None  # wan_pipeline then loads the teacher's own
    for steps in (4, 2):  # its own K, or another count on the same schedule
        scheduler = student_scheduler(spec, 4, steps)
        scheduler.set_timesteps(steps)
        assert torch.equal(scheduler.timesteps.float(), student_schedule(spec, steps)[0])


def few_step_run(finished, tmp_path, steps: int | None):
    """A copy of a finished tiny run whose saved config says its student takes `steps` steps."""
    folder = tmp_path / "run"
    shutil.copytree(finished, folder)
    path = folder / ".hydra" / "config.yaml"
    cfg = OmegaConf.load(path)
    OmegaConf.update(cfg, "method", {"name": "trajectory", "steps": steps}, force_add=True)
    OmegaConf.save(cfg, path)
    return folder


def test_a_few_step_runs_pipeline_samples_in_its_k_steps_through_wan_pipeline(finished, tmp_path, tiny_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    k, spec = 2, inspect_teacher(tiny_path)
    folder = few_step_run(finished, tmp_path, k)
    assert open_run(folder).trained_steps == k  # the saved config passes the received-config checks
    export.run_pipeline(folder, tiny_path)  # what a finished run's last step calls
    timesteps, sigmas = student_schedule(spec, k)
    stated = json.loads((folder / "student" / "sampling.json").read_text())
    assert stated["steps"] == k and stated["guidance_scale"] == 1.0 and len(stated["sigmas"]) == k + 1
    assert stated["timesteps"] == pytest.approx(timesteps.tolist(), abs=1e-3)
    assert json.loads((folder / "pipeline" / "transformer" / "sampling.json").read_text()) == stated
    pipe = WanPipeline.from_pretrained(folder / "pipeline")
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    pipe.scheduler.set_timesteps(k)
    assert torch.equal(pipe.scheduler.timesteps.float(), timesteps)
    assert torch.allclose(pipe.scheduler.sigmas.float(), sigmas)
    calls = []
    pipe.transformer.register_forward_hook(lambda *_: calls.append(1))
    out = pipe("a fox in the snow", num_inference_steps=k, guidance_scale=1.0, num_frames=1, height=64, width=64,
               output_type="pt", generator=torch.Generator().manual_seed(0)).frames  # fmt: skip
    assert len(calls) == k and torch.isfinite(out).all()  # one network call per step: no CFG
    card = (folder / "pipeline" / "README.md").read_text()
    stated_ts = ", ".join(f"{t:.0f}" for t in timesteps.tolist())
    assert f"It is a {k}-step student" in card and f"| sampling | {k} steps (timesteps {stated_ts})" in card
    assert f"num_inference_steps={k}, guidance_scale=1.0" in card and "VAE and scheduler are" not in card


def test_a_kd_runs_pipeline_is_as_before(finished, tmp_path, tiny_path):
    folder = few_step_run(finished, tmp_path, None)
    export.run_pipeline(folder, tiny_path)
    assert not (folder / "student" / "sampling.json").exists()
    assert not (folder / "pipeline" / "transformer" / "sampling.json").exists()
    scheduler = folder / "pipeline" / "scheduler" / "scheduler_config.json"
    assert scheduler.samefile(tiny_path / "scheduler" / "scheduler_config.json")  # the teacher's, linked
    index = json.loads((folder / "pipeline" / "model_index.json").read_text())
    assert index["scheduler"] == json.loads((tiny_path / "model_index.json").read_text())["scheduler"]
    card = (folder / "pipeline" / "README.md").read_text()
    assert "step student" not in card and "num_inference_steps" not in card
    assert "VAE and scheduler are the teacher's.\n\n| | |" in card
