"""`overhead`: the framework's training loop against a hand-written loop doing the same arithmetic (the
same tiny teacher and student, guided targets, MSE, AdamW, clipping, LR schedule) in the same process,
interleaved, median of several repetitions after warm-up. Target: <= 1.10x.
"""

from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from wandistiller.compose import register_configs
from wandistiller.config import CONF_DIR
from wandistiller.core.distributed import Topology
from wandistiller.core.hydra import auto_precision
from wandistiller.core.precision import Precision
from wandistiller.data.batches import BatchSettings, batch_source
from wandistiller.data.prompts import encode_prompts, read_prompts
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.recipe.loop import Run, train_loop
from wandistiller.recipe.targets import LocalTargets
from wandistiller.student.model import build_student
from wandistiller.teacher.spec import inspect_teacher, resolve_teacher_path
from wandistiller.tracking.loggers import NullTracker


def bench_setup(cache_dir: Path, batch_size: int):

    register_configs()
    conf = CONF_DIR
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(
            "train",
            overrides=[
                f"paths.cache_dir={cache_dir}",
                "paths.output_dir=/tmp/unused",
                "precision=fp32",
                f"trainer.batch_size={batch_size}",
                "logger=none",
            ],
        )
    precision = Precision.from_config(auto_precision(cfg.precision))
    spec = inspect_teacher(resolve_teacher_path(cfg.teacher, cfg.paths.cache_dir))
    teacher = CpuPlacement().load(spec, cfg.teacher, precision, Topology())
    embeddings = encode_prompts(
        spec, read_prompts(None), "", 512, precision.teacher_dtype, torch.device("cpu"), cache_dir
    )
    torch.manual_seed(0)
    student = build_student(spec, builder=cfg.student.builder, init="teacher")
    return cfg, spec, teacher, embeddings, student, precision


def framework_steps(cfg, spec, teacher, embeddings, student, precision, steps: int) -> float:
    """Seconds per step of wandistiller's own loop (no checkpoints, no tracker, no progress bar)."""
    trainer = OmegaConf.merge(cfg.trainer, {"max_steps": steps, "checkpoint_every": 10**9, "progress_bar": False})
    run = framework_run(cfg, spec, teacher, embeddings, student, precision, steps)
    start = time.perf_counter()
    train_loop(run, trainer, 0)
    return (time.perf_counter() - start) / steps


def framework_run(cfg, spec, teacher, embeddings, student, precision, steps: int) -> Run:
    """What the loop drives: `student` trained on the teacher's guided targets (the default loss and method)."""
    from diffusers.optimization import get_scheduler

    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)
    shape = (16, cfg.data.latent_frames, cfg.data.latent_height, cfg.data.latent_width)
    batch_fn = batch_source(BatchSettings(0, cfg.trainer.batch_size, shape, spec.flow_shift, 1000, embeddings))
    run = Run(
        model=student,
        targets=LocalTargets(teacher),
        batch_fn=batch_fn,
        optimizer=optimizer,
        lr_scheduler=get_scheduler("cosine", optimizer, num_warmup_steps=10, num_training_steps=steps),
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        ema=None,
        tracker=NullTracker(),
        precision=precision,
        device=torch.device("cpu"),
        run_dir=Path("/tmp/unused"),
        is_main=False,
    )
    return run


def hand_batch(embeddings, shape: tuple, step: int):
    """Step `step`'s batch as a minimal script draws it: (x_t, t, text states), x_t on Wan's shifted (3.0) sigmas."""
    g = torch.Generator().manual_seed(step)
    cond = embeddings.padded(torch.randint(len(embeddings.embeds), (shape[0],), generator=g))
    x0, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    u = torch.rand(shape[0], generator=g)
    sigma = 3.0 * u / (1 + 2.0 * u)
    s = sigma.view(-1, 1, 1, 1, 1)
    return (1 - s) * x0 + s * noise, sigma * 1000, cond


@torch.no_grad()
def hand_target(expert, guidance: float, x_t, t, cond, uncond) -> torch.Tensor:
    """The guided velocity a minimal script computes: one cond+uncond call of the frozen `expert`, in float32."""
    pred = expert(
        hidden_states=torch.cat([x_t, x_t]),
        timestep=torch.cat([t, t]),
        encoder_hidden_states=torch.cat([cond, uncond]),
        return_dict=False,
    )[0]
    c, un = pred.float().chunk(2)
    return un + guidance * (c - un)


def handwritten_steps(cfg, spec, teacher, embeddings, student, steps: int) -> float:
    """The same arithmetic written out by hand: what a minimal script would do."""
    from diffusers.optimization import get_scheduler

    expert, scale, b = teacher.experts[0], teacher.guidance_scales[0], cfg.trainer.batch_size
    shape = (b, 16, cfg.data.latent_frames, cfg.data.latent_height, cfg.data.latent_width)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=10, num_training_steps=steps)
    uncond = embeddings.negative_batch(b)
    start = time.perf_counter()
    for step in range(steps):
        x_t, t, cond = hand_batch(embeddings, shape, step)
        target = hand_target(expert, scale, x_t, t, cond, uncond)
        out, _ = student(x_t, t, cond)
        loss = F.mse_loss(out.float(), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss.item()
    return (time.perf_counter() - start) / steps


def overhead(args) -> dict:
    cfg, spec, teacher, embeddings, student, precision = bench_setup(Path(args.cache_dir).expanduser(), args.batch_size)
    framework_steps(cfg, spec, teacher, embeddings, student, precision, 5)  # warm-up both paths
    handwritten_steps(cfg, spec, teacher, embeddings, student, 5)
    ours, theirs = [], []
    for _ in range(args.reps):  # interleaved, so drift hits both alike
        ours.append(framework_steps(cfg, spec, teacher, embeddings, student, precision, args.steps))
        theirs.append(handwritten_steps(cfg, spec, teacher, embeddings, student, args.steps))
    result = {
        "benchmark": "overhead",
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "batch_size": args.batch_size,
        "steps": args.steps,
        "reps": args.reps,
        "framework_ms_per_step": 1e3 * statistics.median(ours),
        "handwritten_ms_per_step": 1e3 * statistics.median(theirs),
        "ratio": statistics.median(ours) / statistics.median(theirs),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(
        f"{'loop':<14}{'ms/step (median)':>18}\n{'wandistiller':<14}{result['framework_ms_per_step']:>18.2f}\n"
        f"{'hand-written':<14}{result['handwritten_ms_per_step']:>18.2f}\nratio {result['ratio']:.3f}x "
        f"(target <= 1.10x)"
    )
    return result
