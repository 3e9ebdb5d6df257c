"""wandistiller/recipe/methods/base.py (and the registry of conf/method/): every method YAML composes into its own
schema and builds its class; a method's name and step count are checked as it is built; a method that calls the
teacher at the student's inputs is refused, in one line, on a teacher served to other ranks."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate

from tests.conftest import CONF, refused
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.placements.gpu import GpuPlacement
from wandistiller.recipe.methods import REGISTRY, Method


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "method").glob("*.yaml")))
def test_every_method_yaml_builds_its_own_class_and_carries_its_name_and_steps(make_cfg, name):
    cfg = make_cfg(f"method={name}")
    built = instantiate(cfg.method)
    assert type(built) is REGISTRY.get(name).cls and cfg.method.name == name == built.name
    assert cfg.method.steps == built.steps  # what sampling the student reads back from the run's config


def test_every_method_module_has_its_yaml():
    assert set(REGISTRY.names()) == {p.stem for p in (CONF / "method").glob("*.yaml")}


class AtStudentInputs(Method):
    name = "at_student_inputs"
    student_inputs = True


def test_a_method_is_built_with_its_own_name_and_a_positive_step_count():
    with refused("method.name='kd' belongs to method=kd"):
        AtStudentInputs("kd")
    with refused("method.steps=0 must be at least 1"):
        AtStudentInputs("at_student_inputs", 0)


def test_the_teacher_at_the_students_inputs_is_refused_where_an_owner_serves_other_ranks():
    import torch

    method, cpu = AtStudentInputs("at_student_inputs", 2), torch.device("cpu")
    method.check(CpuPlacement(), 1, cpu)  # one process: its own teacher
    method.check(GpuPlacement(), 2, cpu)  # every rank its own teacher
    with refused("method=at_student_inputs calls the teacher at inputs the student makes, which teacher_placement=cpu"):
        method.check(CpuPlacement(), 2, cpu)
