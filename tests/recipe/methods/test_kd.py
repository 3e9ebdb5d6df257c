"""wandistiller/recipe/methods/kd.py: `method=kd` (the default) is the distillation step of before methods, bit for
bit: the loop with it gives the loss curve of the loop body it replaced (distill_step on the data's batch)."""

from __future__ import annotations

from dataclasses import replace

import pytest
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


@pytest.mark.parametrize(
    "twin,student", [("tiny_i2v", "half"), ("tiny_i2v", "lora"), ("tiny_i2v_moe", "lora"), ("tiny_ti2v", "half")]
)
def test_kd_trains_cut_and_lora_students_of_image_to_video_teachers_on_the_teachers_own_conditioning(
    twin, student, request, tmp_path
):
    """The real loop and method=kd at toy size on a tiny image-to-video twin, each prompt paired with an image:
    the student takes the conditioning the teacher takes, its own way in (the image channels of its patch
    embedding, Wan 2.1's image-token attention) learns, and a LoRA student starts as the teacher itself."""
    from tests.conftest import encode_condition
    from tests.teacher.test_image import an_image
    from wandistiller.student.lora import build_lora_student
    from wandistiller.student.model import build_student
    from wandistiller.teacher.image import load_image_encoder
    from wandistiller.teacher.vae import load_vae

    spec = inspect_teacher(request.getfixturevalue(f"{twin}_path"))
    # CFG 1: the target is the conditional velocity, which a LoRA student with zero adapters gives exactly.
    guidance = OmegaConf.create({"guidance_scale": 1.0, "guidance_scale_2": None})
    teacher = CpuPlacement().load(spec, guidance, FP32, Topology())
    cpu = torch.device("cpu")
    images = encode_condition(spec, load_vae(spec, cpu), [an_image(i) for i in range(4)], 2, 64, 64,
                              *load_image_encoder(spec, cpu))  # fmt: skip
    side = 64 // (16 if spec.latent_channels == 48 else 8)
    run = toy_run(spec, teacher, tmp_path, 0.0, latent_shape=(spec.latent_channels, 2, side, side))
    torch.manual_seed(0)
    run.model = (
        build_lora_student(spec, teacher=teacher, rank=4)
        if student == "lora"
        else build_student(spec, builder="half", init="teacher")
    )
    run.optimizer = torch.optim.AdamW([p for p in run.model.parameters() if p.requires_grad], lr=3e-3)
    run.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lambda step: 1.0)
    plain = run.batch_fn
    run.batch_fn = lambda step, micro, rank: replace(b := plain(step, micro, rank), image=images.select(b.prompt_idx))
    run.method = OPTION.build()
    before = {n: p.detach().clone() for n, p in run.model.named_parameters() if p.requires_grad}
    history = train_loop(run, OmegaConf.create(TRAINER | {"grad_accum_steps": 1, "max_steps": 8}), start_step=0)

    losses = [h["loss"] for h in history]
    if student == "lora":
        assert losses[0] < 1e-9, losses  # the teacher itself, fed the same image: its own target
    assert min(losses[-3:]) < losses[0] or losses[0] < 1e-9, losses
    if student == "half":  # its way in for the image learned (the mask and image latents' channels, TI2V aside)
        changed = {n for n, p in run.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])}
        assert "transformer.patch_embedding.weight" in changed
        if spec.image_encoder:
            assert {
                "transformer.blocks.0.attn2.add_k_proj.weight",
                "transformer.condition_embedder.image_embedder.ff.net.0.proj.weight",
            } <= changed
    # The image matters: another image for the same noisy latents and prompt, another prediction.
    batch = run.batch_fn(0, 0, 0)
    other = replace(images.select(batch.prompt_idx), latents=images.select(batch.prompt_idx.flip(0)).latents)
    with torch.no_grad():
        mine, _ = run.model(batch.x_t, batch.t, batch.cond, batch.image)
        theirs, _ = run.model(batch.x_t, batch.t, batch.cond, other)
    assert not torch.equal(mine, theirs)
