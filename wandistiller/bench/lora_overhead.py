"""`overhead --student lora`: the framework's LoRA student step against a hand-written LoRA step (issue 43, target
3: at most 1.10x on the CPU, tiny teacher, batch 1).

The framework's side is `student=lora method=kd` as the loop runs it: the placed teacher with the student's
adapters (teacher/lora.py), trained through `train_loop` on the same teacher's guided targets. kd is the simplest
method a LoRA student trains with (one student call and one teacher call a step); dmd adds a fake score and a
rollout that a hand-written dmd would pay alike, so they would only dilute the ratio.

The hand-written side is what a minimal script would write: the same frozen teacher, each adapted Linear swapped
for a plain module computing `W x + b + (alpha / rank) B (A x)` (its frozen weights shared, not copied), the
same rank, alpha and A/B values, MSE to the cond/uncond blend of one batched teacher call, AdamW, clipping at 1.0
and the cosine schedule. `first_step` runs one batch through both before anything is timed and reports how far
their losses and gradients are apart: the ratio means something only where they compute the same thing.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from wandistiller.bench.overhead import bench_setup, framework_run, framework_steps, hand_batch, hand_target
from wandistiller.config import CONF_DIR
from wandistiller.recipe.loop import distill_step
from wandistiller.student.lora import BUILDER, build_lora_student, lora_settings
from wandistiller.teacher.lora import Adapters, strip_adapters
from wandistiller.teacher.model import blocks_of, compile_blocks

LR, BETAS, WARMUP, MAX_NORM = 1e-3, (0.9, 0.99), 10, 1.0  # as overhead.framework_run's


class HandLoRALinear(nn.Module):
    """One adapted Linear as a hand-written script has it: the frozen layer and its own A and B."""

    def __init__(self, base: nn.Module, down: torch.Tensor, up: torch.Tensor, scale: float):
        super().__init__()
        self.base, self.scale = base, scale
        self.down, self.up = nn.Parameter(down.detach().clone()), nn.Parameter(up.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * F.linear(F.linear(x, self.down), self.up)


def hand_models(expert: nn.Module, adapters: Adapters) -> tuple[nn.Module, nn.Module, list[nn.Parameter]]:
    """What a hand-written script holds: the plain teacher (its targets) and an adapted one whose adapted Linears
    are HandLoRALinear with `adapters`' current A and B, and those parameters (in `adapters`' order). Both are
    copies of `expert` that share its frozen tensors (the memo), so they read the same memory and hold no second
    teacher, and neither carries the framework's adapter hooks (a script has none to pay for)."""
    memo: dict[int, object] = {id(p): p for p in expert.parameters()}
    plain = copy.deepcopy(expert, memo=memo | {id(adapters): adapters})
    strip_adapters(plain)  # the copy's adapter hooks and what they hold
    adapted = copy.deepcopy(plain, memo=dict(memo))
    params: list[nn.Parameter] = []
    for key, name in adapters.layers.items():
        parent, child = name.rsplit(".", 1)
        holder = adapted.get_submodule(parent)
        layer = HandLoRALinear(getattr(holder, child), adapters.down[key], adapters.up[key], adapters.scale)
        setattr(holder, child, layer)
        params += [layer.down, layer.up]
    return plain, adapted, params


def hand_loss(adapted, plain, guidance, x_t, t, cond, uncond) -> torch.Tensor:
    """MSE of the adapted model's prediction to the guided target of the plain teacher (one cond+uncond call)."""
    target = hand_target(plain, guidance, x_t, t, cond, uncond)
    out = adapted(hidden_states=x_t, timestep=t, encoder_hidden_states=cond, return_dict=False)[0]
    return F.mse_loss(out.float(), target)


def hand_steps(cfg, teacher, embeddings, models, optimizer, steps: int) -> float:
    """Seconds per hand-written LoRA step, batches drawn inline as overhead.handwritten_steps draws them."""
    from diffusers.optimization import get_scheduler

    (plain, adapted, params), guidance, b = models, teacher.guidance_scales[0], cfg.trainer.batch_size
    shape = (b, 16, cfg.data.latent_frames, cfg.data.latent_height, cfg.data.latent_width)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=WARMUP, num_training_steps=steps)
    uncond = embeddings.negative_batch(b)
    start = time.perf_counter()
    for step in range(steps):
        x_t, t, cond = hand_batch(embeddings, shape, step)
        loss = hand_loss(adapted, plain, guidance, x_t, t, cond, uncond)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss.item()
    return (time.perf_counter() - start) / steps


def lora_student(cfg, spec, teacher):
    """`student=lora` as the recipe builds it (its shipped rank, alpha and layers), on the placed teacher."""
    keys = OmegaConf.load(CONF_DIR / "student" / f"{BUILDER}.yaml")
    rank, alpha, names = lora_settings(keys)
    torch.manual_seed(0)
    return build_lora_student(spec, torch.float32, teacher=teacher, rank=rank, alpha=alpha, layers=list(names))


def first_step(cfg, spec, teacher, embeddings, student, precision, models) -> dict:
    """One batch (the framework's step 0) through both: the losses and every adapter gradient, compared. B is
    set to the same small random values on both first (B starts at zero, so A's gradients would be zero on both
    and prove nothing), then put back, so the timed training starts from the shipped init."""
    (plain, adapted, params), adapters = models, cast(Adapters, student.adapters[0])
    g = torch.Generator().manual_seed(1)
    bumped = {k: 0.01 * torch.randn(adapters.up[k].shape, generator=g) for k in adapters.layers}
    saved = {k: adapters.up[k].detach().clone() for k in adapters.layers}
    with torch.no_grad():
        for i, key in enumerate(adapters.layers):
            adapters.up[key].copy_(bumped[key])
            params[2 * i + 1].copy_(bumped[key])
    run = framework_run(cfg, spec, teacher, embeddings, student, precision, 1)
    batch = run.batch_fn(0, 0, 0)
    ours, _, _ = distill_step(run, 0, 0, batch)
    ours.backward()
    theirs = hand_loss(adapted, plain, teacher.guidance_scales[0], batch.x_t, batch.t, batch.cond, batch.uncond)
    theirs.backward()
    framework_grads = [p.grad for key in adapters.layers for p in (adapters.down[key], adapters.up[key])]
    worst = max(float((a - cast(torch.Tensor, b.grad)).abs().max()) for a, b in zip(framework_grads, params))
    scale = max(float(a.abs().max()) for a in framework_grads)
    with torch.no_grad():
        for i, key in enumerate(adapters.layers):
            adapters.up[key].copy_(saved[key])
            params[2 * i + 1].copy_(saved[key])
    for p in [*student.parameters(), *params]:
        p.grad = None
    losses = {"framework_loss": float(ours.detach()), "handwritten_loss": float(theirs.detach())}
    return losses | {"grad_max_abs_diff": worst, "grad_max_abs": scale}


def lora_overhead(args) -> dict:
    cfg, spec, teacher, embeddings, _, precision = bench_setup(Path(args.cache_dir).expanduser(), args.batch_size)
    student = lora_student(cfg, spec, teacher)
    models = hand_models(teacher.experts[0], cast(Adapters, student.adapters[0]))
    check = first_step(cfg, spec, teacher, embeddings, student, precision, models)  # eager: bit for bit
    compiled = bool(getattr(args, "compile", False))
    if compiled:  # each side's blocks, as teacher.compile=true compiles them; the warm-up below compiles
        compile_blocks(teacher.experts[0])
        for block in [*blocks_of(models[0]), *blocks_of(models[1])]:  # no adapter hooks made room for
            block.forward = torch.compile(block.forward, fullgraph=True)
    optimizer = torch.optim.AdamW(models[2], lr=LR, betas=BETAS, weight_decay=0.0)
    framework_steps(cfg, spec, teacher, embeddings, student, precision, 5)  # warm-up both paths
    hand_steps(cfg, teacher, embeddings, models, optimizer, 5)
    ours, theirs, ours_cpu, theirs_cpu = [], [], [], []
    for _ in range(args.reps):  # interleaved, so drift hits both alike
        # CPU time beside the wall clock: on a VM shared with other jobs the wall clock is mostly their load (two
        # runs 20% apart either way), while this process's CPU seconds count its own work (one thread: OMP 1).
        cpu = time.process_time()
        ours.append(framework_steps(cfg, spec, teacher, embeddings, student, precision, args.steps))
        ours_cpu.append((time.process_time() - cpu) / args.steps)
        cpu = time.process_time()
        theirs.append(hand_steps(cfg, teacher, embeddings, models, optimizer, args.steps))
        theirs_cpu.append((time.process_time() - cpu) / args.steps)
    adapters = cast(Adapters, student.adapters[0])
    result = {
        "benchmark": "overhead",
        "student": BUILDER,
        "method": "kd",
        "compiled": compiled,
        "rank": adapters.rank,
        "alpha": adapters.alpha,
        "adapted_layers": len(adapters.layers),
        "threads": torch.get_num_threads(),
        "batch_size": args.batch_size,
        "steps": args.steps,
        "reps": args.reps,
        "first_step": check,
        "framework_ms_per_step": 1e3 * statistics.median(ours),
        "handwritten_ms_per_step": 1e3 * statistics.median(theirs),
        "ratio": statistics.median(ours) / statistics.median(theirs),
        "framework_cpu_ms_per_step": 1e3 * statistics.median(ours_cpu),
        "handwritten_cpu_ms_per_step": 1e3 * statistics.median(theirs_cpu),
        "cpu_ratio": statistics.median(ours_cpu) / statistics.median(theirs_cpu),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(
        f"first step: loss {check['framework_loss']:.6g} (framework) vs {check['handwritten_loss']:.6g} "
        f"(hand-written), adapter gradients apart by at most {check['grad_max_abs_diff']:.3g} "
        f"(largest {check['grad_max_abs']:.3g})\n"
        + ("both sides' blocks compiled (teacher.compile=true's compile_blocks)\n" if compiled else "")
        + f"{'LoRA step':<14}{'ms/step (median)':>18}{'CPU ms/step':>13}\n"
        f"{'wandistiller':<14}{result['framework_ms_per_step']:>18.2f}{result['framework_cpu_ms_per_step']:>13.2f}\n"
        f"{'hand-written':<14}{result['handwritten_ms_per_step']:>18.2f}{result['handwritten_cpu_ms_per_step']:>13.2f}\n"
        f"CPU-time ratio {result['cpu_ratio']:.3f}x\nratio {result['ratio']:.3f}x (target <= 1.10x)"
    )
    return result
