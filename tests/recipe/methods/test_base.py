"""wandistiller/recipe/methods/base.py (and the registry of conf/method/): every method YAML composes into its own
schema and builds its class; a method's name and step count are checked as it is built; a method that calls the
teacher at the student's inputs takes every placement (a served teacher receives them); a method with its own loss
refuses a trainer.loss set for it, in one line."""

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


def test_the_teacher_at_the_students_inputs_is_taken_by_every_serving_mode():
    """A served teacher receives the student's inputs from its ranks (recipe/targets.py): no placement refuses them."""
    import torch

    from wandistiller.placements.gpu0 import Gpu0Placement

    method, cpu = AtStudentInputs("at_student_inputs", 2), torch.device("cpu")
    for placement in (CpuPlacement(), GpuPlacement(), Gpu0Placement(debug_cpu=True)):
        for ranks in (1, 2):
            method.check(placement, ranks, cpu)


def test_a_method_with_its_own_loss_refuses_a_trainer_loss_set_for_it(make_cfg):
    from wandistiller.job.preflight import check_method_loss

    class OwnLoss(AtStudentInputs):
        uses_loss = False

    method = OwnLoss("at_student_inputs", 2)
    check_method_loss(make_cfg(), method)  # the default loss: nothing set, nothing refused
    check_method_loss(make_cfg("trainer.loss.hidden_kd_weight=0.5"), AtStudentInputs("at_student_inputs", 2))
    with refused("method=at_student_inputs trains with its own loss and ignores trainer.loss, which sets "
                 "loss=task; drop it (loss=distillation as it ships)"):  # fmt: skip
        check_method_loss(make_cfg("loss=task"), method)
    with refused("which sets trainer.loss.hidden_kd_weight=0.5"):
        check_method_loss(make_cfg("trainer.loss.hidden_kd_weight=0.5"), method)


def test_a_method_that_reads_no_x0_refuses_a_source_that_samples_the_teacher_for_it(make_cfg):
    """data=teacher_latents samples the teacher's whole sampler before training: hours at scale, for nothing."""
    from wandistiller.core.distributed import World
    from wandistiller.job.checks import built_quietly
    from wandistiller.job.preflight import check_combination

    one = World(nproc_per_node=1, nnodes=1)

    def check(cfg):
        check_combination(cfg, CpuPlacement(), one, built_quietly(cfg.method))

    check(make_cfg("data=teacher_latents"))  # kd reads x0
    for method in ("trajectory", "dmd"):
        with refused(f"data.latents=teacher samples the teacher's own latents for x0 before training, and "
                     f"method={method} never reads x0"):  # fmt: skip
            check(make_cfg(f"method={method}", "data=teacher_latents"))
        check(make_cfg(f"method={method}"))  # its prompts alone


@pytest.mark.parametrize(("steps", "teacher_steps", "message"), [
    (4, 100_000_000, "method.teacher_steps=100000000 is more than a Wan scheduler's 1000 training timesteps"),
    (4, 1001, "method.teacher_steps=1001 is more than"),
    (2000, 1000, "method.steps=2000 is more than the teacher's sample steps"),
])  # fmt: skip
def test_a_step_count_past_the_teachers_timesteps_is_one_line_before_any_work(steps, teacher_steps, message):
    """method.teacher_steps=100000000 used to allocate its schedule until the kernel killed the process."""
    from wandistiller.core.errors import UserError
    from wandistiller.recipe.methods.base import steps_within

    with pytest.raises(UserError, match=message) as e:
        steps_within(steps, teacher_steps)
    assert "\n" not in str(e.value)
    assert steps_within(4, 1000) == 4
