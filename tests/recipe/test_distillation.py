"""wandistiller/recipe/distillation.py: `DistillationRecipe`'s `_setup_*` steps called one by one on a prepared
tiny run (the loss, batches, targets, student and optimization they build), and what a user swaps through
`_target_` (the loss, the student builder, the recipe) in real runs."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers.training_utils import EMAModel
from omegaconf import OmegaConf

from tests.conftest import cli, fresh_runs, old_shape_loss
from wandistiller.core.distributed import Topology
from wandistiller.data.prompts import PromptEmbeddings
from wandistiller.job.preflight import prepare
from wandistiller.recipe.distillation import DistillationRecipe
from wandistiller.recipe.losses.distillation import Distillation
from wandistiller.recipe.losses.task import Task
from wandistiller.recipe.targets import LocalTargets, WholeStepTargets
from wandistiller.student.model import build_student
from wandistiller.train import run

CALLS: list[str] = []


def doubled_loss(pred, target, student_hidden, teacher_hidden, hidden_kd_weight: float = 0.0):
    """A user's loss: twice the velocity MSE (what trainer.loss._target_ may name)."""
    loss, velocity, hidden = old_shape_loss(pred, target, student_hidden, teacher_hidden, hidden_kd_weight)
    CALLS.append("loss")
    return 2 * loss, velocity, hidden


def counted_student(spec, dtype=torch.float32, **student_keys):
    """A user's student builder (what student._target_ may name)."""
    CALLS.append("student")
    return build_student(spec, dtype, **student_keys)


class CountingRecipe(DistillationRecipe):
    """A user's recipe (what recipe._target_ may name): one setup step replaced."""

    def _setup_tracker(self, state):
        CALLS.append("tracker")
        return super()._setup_tracker(state)


def test_loss_student_and_recipe_are_swapped_through_their_targets(make_cfg, tmp_path):
    CALLS.clear()
    cfg = make_cfg(
        "trainer.max_steps=2",
        f"trainer.loss._target_={__name__}.doubled_loss",
        f"student._target_={__name__}.counted_student",
        f"recipe._target_={__name__}.CountingRecipe",
        run_dir=tmp_path / "r",
    )
    summary = run(cfg)
    assert summary["steps_run"] == 2
    assert CALLS.count("student") == 1 and CALLS.count("tracker") == 1 and CALLS.count("loss") == 2


@pytest.fixture(scope="module", autouse=True)  # autouse: it starts with the module, beside its in-process tests
def clis(request, tmp_path_factory, cache_dir):
    """This module's command-line run (a fresh process) and its folder, started with the module."""
    tmp_path = tmp_path_factory.mktemp("cli")
    args = cli(f"hydra.run.dir={tmp_path / 'r'}", f"paths.cache_dir={cache_dir}", "logger=none",
               "recipe._target_=nowhere.Recipe")  # fmt: skip
    return tmp_path, fresh_runs(request, {"nowhere": ("test_a_target_that_does_not_exist_is_one_line", args)})


def test_a_target_that_does_not_exist_is_one_line(clis):
    tmp_path, runs = clis
    result = runs["nowhere"].result()
    assert result.returncode == 2 and "Traceback" not in result.stderr and "recipe._target_" in result.stderr
    assert not (tmp_path / "r").exists()  # refused before the run folder is claimed


def prepared_recipe(make_cfg, run_dir, *overrides: str) -> DistillationRecipe:
    """The recipe of a tiny run as `train.run` makes it (preflight done, the run folder claimed), before setup."""
    cfg = make_cfg(*overrides, run_dir=run_dir)
    return DistillationRecipe(cfg, prepare(cfg, Topology()), Topology())


def changed(recipe: DistillationRecipe, keys: dict) -> DistillationRecipe:
    """The same prepared run with some config keys changed (no second compose and preflight: each costs ~0.5 s)."""
    cfg = recipe.cfg.copy()
    for key, value in keys.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return DistillationRecipe(cfg, recipe.prepared, recipe.topo)


def two_prompts() -> PromptEmbeddings:
    """Random text states at the tiny teacher's text width, in place of the encoder's."""
    g = torch.Generator().manual_seed(0)
    return PromptEmbeddings(["a", "b"], [torch.randn(n, 32, generator=g) for n in (3, 5)], torch.zeros(0, 32), 512)


def test_the_loss_decides_what_batches_carry_and_the_trainer_where_targets_come_from(make_cfg, tmp_path):
    default = prepared_recipe(make_cfg, tmp_path / "r", "trainer.batch_size=3", "trainer.grad_accum_steps=3")
    assert isinstance(default.loss_fn, Distillation) and default.loss_fn is default.loss_fn  # built once
    default.teacher, default.batch_fn = None, default._setup_batches(two_prompts(), None)  # what setup made first
    batch = default.batch_fn(0, 0, 0)
    assert batch.x_t.shape == (3, *default.ctx.latent_shape) and batch.x0 is None and batch.noise is None
    assert type(default._setup_targets()) is LocalTargets and default.transfer_device() == torch.device("cpu")

    task = changed(default, {"trainer.loss": {"_target_": "wandistiller.recipe.losses.task.Task", "_partial_": True}})
    assert isinstance(task.loss_fn, Task)
    batch = task._setup_batches(two_prompts(), None)(0, 0, 0)
    assert batch.x0.shape == batch.noise.shape == batch.x_t.shape

    whole = changed(default, {"trainer.teacher_whole_step": True})
    whole.teacher, whole.batch_fn = None, default.batch_fn
    targets = whole._setup_targets()
    assert isinstance(targets, WholeStepTargets) and targets.accum == 3 and targets.dp_rank == 0


def test_the_student_and_its_optimization_follow_the_trainer_keys(make_cfg, tmp_path):
    keys = ["trainer.optimizer.lr=0.002", "trainer.warmup_steps=4", "trainer.max_steps=8", "trainer.ema_decay=0.9"]
    recipe = prepared_recipe(make_cfg, tmp_path / "r", *keys)
    student = recipe._setup_student()
    assert student.training and all(p.device.type == "cpu" for p in student.parameters())
    pruning = json.loads((tmp_path / "r" / "pruning.json").read_text())  # tiny: 2 of the teacher's 4 blocks, scored
    assert len(pruning["block_scores"]) == 4 and pruning["kept_blocks"] == student.pruning["kept_blocks"]
    optimizer, lr_scheduler, scaler, ema = recipe._setup_optimization(student, None)
    trained = {id(p) for p in student.parameters() if p.requires_grad}
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == trained
    assert optimizer.param_groups[0]["initial_lr"] == 0.002
    assert lr_scheduler.get_last_lr() == [0.0]  # warming up from zero
    assert not scaler.is_enabled() and isinstance(ema, EMAModel) and ema.decay == 0.9  # fp32: no grad scaler
