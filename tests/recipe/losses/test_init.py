"""wandistiller/recipe/losses/__init__.py: the registry of loss options against conf/loss/, `as_loss` on old-shape
functions and partials, and each option training in a real run (one on two ranks)."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import ROOT, background_job, cli, job_result, metrics_steps, old_shape_loss, session_env
from tests.recipe.losses.test_base import inputs
from wandistiller.recipe.losses import REGISTRY, as_loss, total
from wandistiller.recipe.losses.base import LAST, Needs
from wandistiller.recipe.losses.blend import Blend
from wandistiller.train import run


def test_old_shape_functions_and_partials_become_losses():
    from functools import partial

    legacy = as_loss(partial(old_shape_loss, hidden_kd_weight=0.5))
    assert total(legacy(inputs())) == 3.0 and legacy.needs == Needs(
        teacher=True, teacher_hidden=LAST, student_hidden=LAST
    )
    built = as_loss(partial(Blend, alpha=0.0))
    assert isinstance(built, Blend) and built.alpha == 0.0


def test_every_loss_module_has_its_yaml_and_old_targets_still_resolve():
    from hydra.utils import get_object
    from omegaconf import OmegaConf

    from tests.conftest import CONF
    from wandistiller.core.renamed import current_target

    yamls = {p.stem: OmegaConf.load(p)._target_ for p in (CONF / "loss").glob("*.yaml")}
    assert set(REGISTRY.names()) == set(yamls)
    assert all(get_object(target) is REGISTRY.get(name).cls for name, target in yamls.items())  # its own module's
    for old in ("wandistiller.losses.Blend", "wandistiller.recipe.losses.Blend"):  # saved by older runs
        assert get_object(current_target(old)) is Blend and current_target(old) == yamls["blend"]


@pytest.mark.parametrize(
    ("option", "keys"),
    [
        ("distillation", {"loss_velocity", "loss_hidden"}),
        ("task", {"loss_task"}),
        ("blend", {"loss_task", "loss_velocity"}),
    ],
)
def test_each_loss_option_trains(make_cfg, tmp_path, option, keys):
    summary = run(make_cfg(f"loss={option}", "trainer.max_steps=3", "trainer.log_every=1", run_dir=tmp_path / "r"))
    assert summary["steps_run"] == 3
    rows = metrics_steps(tmp_path / "r")
    assert all(keys | {"loss"} <= set(r) and r["loss"] > 0 for r in rows)
    if option == "task":  # no teacher call at all: its time is the two clock marks around nothing
        assert all(r["teacher_ms"] < 1.0 for r in rows)


TASK_ON_TWO_RANKS = ["logger=none", "distributed.nproc_per_node=2", "teacher_placement=cpu", "loss=task",
                     "trainer.max_steps=3", "hooks.samples.prompts=0", "hooks.monitor.val_every=0",
                     "~hooks.evaluate", "trainer.progress_bar=false", "precision=fp32"]  # fmt: skip


def _train(run_dir, args: list[str], env: dict):
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600), run_dir


@background_job("task_loss_two_ranks")
def _start_task_loss_two_ranks(request, submit):
    """The 2-rank run below, started with the session (conftest.session_jobs) when its test is selected."""
    cache_dir, factory = request.getfixturevalue("cache_dir"), request.getfixturevalue("tmp_path_factory")
    request.getfixturevalue("tiny_path")
    run_dir = factory.mktemp("task_loss_two_ranks") / "r"
    args = cli(f"hydra.run.dir={run_dir}", f"paths.cache_dir={cache_dir}", *TASK_ON_TWO_RANKS)
    env = session_env(request)  # copied now: a test's monkeypatching never leaks in
    return submit(_train, run_dir, args, env)


@pytest.fixture
def task_loss_two_ranks(session_jobs):
    return job_result(session_jobs, "task_loss_two_ranks")


def test_a_loss_without_the_teacher_still_takes_served_targets_on_two_ranks(task_loss_two_ranks):
    # teacher_placement=cpu: rank 0 owns the teacher and sends rank 1 its targets every micro-batch; a task
    # loss must still receive them (RemoteTargets is not skippable), or the ranks would hang.
    result, run_dir = task_loss_two_ranks
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics_steps(run_dir)
    assert len(rows) == 3 and all("loss_task" in r and "loss_velocity" not in r for r in rows)
