"""wandistiller/recipe/methods/kd.py: `method=kd` (the default) is the distillation step of before methods, bit for
bit: the loop with it gives the loss curve of the loop body it replaced (distill_step on the data's batch)."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from tests.conftest import FP32
from tests.recipe.test_loop import toy_run
from wandistiller.core.distributed import Topology
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.recipe.loop import distill_step, train_loop
from wandistiller.recipe.methods.kd import OPTION
from wandistiller.teacher.spec import inspect_teacher

TRAINER = {"grad_accum_steps": 2, "batch_size": 2, "max_steps": 5, "max_grad_norm": 1.0, "progress_bar": False,
           "checkpoint_every": 100, "log_every": 1, "keep_checkpoints": 1}  # fmt: skip


def loop_before_methods(run, trainer) -> list[tuple[float, float]]:
    """The loop's body as it was before `method=` (its step inlined): (loss, grad norm) per step."""
    rows = []
    for step in range(trainer["max_steps"]):
        total = torch.zeros(())
        for micro in range(trainer["grad_accum_steps"]):
            batch = run.batch_fn(step, micro, run.dp_rank).to(run.device)
            loss, parts, _ = distill_step(run, step, micro, batch)
            run.scaler.scale(loss / trainer["grad_accum_steps"]).backward()
            total = total + parts["loss"].float() / trainer["grad_accum_steps"]
        run.scaler.unscale_(run.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(list(run.model.parameters()), trainer["max_grad_norm"])
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
        run.lr_scheduler.step()
        rows.append((total.item(), norm.item()))
    return rows


def test_kd_trains_the_loss_curve_of_the_loop_before_methods_bit_for_bit(tiny_path, tmp_path):
    spec = inspect_teacher(tiny_path)
    guidance = OmegaConf.create({"guidance_scale": 5.0, "guidance_scale_2": None})
    teacher = CpuPlacement().load(spec, guidance, FP32, Topology())
    before = loop_before_methods(toy_run(spec, teacher, tmp_path / "a", 0.5), TRAINER)
    for method in (None, OPTION.build()):  # a Run without a method trains with kd
        run = toy_run(spec, teacher, tmp_path / f"b{method is None}", 0.5)
        run.method = method
        history = train_loop(run, OmegaConf.create(TRAINER), start_step=0)
        assert [(h["loss"], h["grad_norm"]) for h in history] == before


def test_the_default_method_is_kd_and_its_steps_are_the_teachers(make_cfg):
    cfg = make_cfg()
    assert cfg.method.name == "kd" and cfg.method.steps is None


def test_a_step_count_for_kd_is_refused_pointing_at_the_few_step_methods(make_cfg):
    from hydra.utils import instantiate

    from tests.conftest import refused
    from wandistiller.job.checks import built_quietly

    with refused("method.steps=4 with method=kd: a KD student learns the teacher's velocity"):
        built_quietly(make_cfg("method.steps=4").method)
    assert instantiate(make_cfg().method).steps is None
