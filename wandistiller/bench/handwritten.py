"""The hand-written loop `bench job` compares the framework with: the same arithmetic as
`python -m wandistiller.train` with guided targets, written out as a minimal script would write it.

Same teacher folder, same student (built from the same seed), same batches (drawn from the same seeded
generator), guided targets from one batched cond+uncond teacher call, bf16 autocast for the student, AdamW
(fused on CUDA) with the default config's hyper-parameters, clipping at 1.0, cosine schedule with 10 warm-up
steps. So after the same steps both reach the same loss, which tests/bench/test_job.py checks on the CPU.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from wandistiller.config import CONF_DIR
from wandistiller.data.batches import mixed_seed
from wandistiller.data.prompts import encode_prompts, read_prompts
from wandistiller.data.validation import split_prompts
from wandistiller.recipe.loop import Clock
from wandistiller.student.model import build_student
from wandistiller.teacher.fastpaths import quantize_expert
from wandistiller.teacher.fp8 import relative_mse
from wandistiller.teacher.spec import inspect_teacher

DTYPES = {"bf16": (torch.bfloat16, torch.bfloat16), "fp32": (torch.float32, None)}  # teacher, autocast
GUIDANCE, LR, BETAS, WARMUP, MAX_NORM = 5.0, 1e-3, (0.9, 0.99), 10, 1.0  # conf/teacher/tiny, conf/trainer/default


def setup(args, folder: Path) -> dict:
    """Teacher, student, optimizer, schedule and the prompt table on the device, with the fast paths chosen."""
    from diffusers import WanTransformer3DModel
    from diffusers.optimization import get_scheduler

    device, (teacher_dtype, _) = torch.device(args.device), DTYPES[args.precision]
    spec = inspect_teacher(folder)
    teacher = WanTransformer3DModel.from_pretrained(folder, subfolder="transformer", dtype=teacher_dtype)
    teacher = teacher.to(device).eval().requires_grad_(False)
    train_prompts, _ = split_prompts(read_prompts(None), None)  # the framework trains on all but the held-out 10%
    embeddings = encode_prompts(spec, train_prompts, "", 512, teacher_dtype, device, args.cache_dir)
    table = torch.stack([embeddings.padded(torch.tensor([i]))[0] for i in range(len(embeddings.embeds))])
    torch.manual_seed(args.seed)  # as the framework's worker does before building the student
    student_keys = cast(dict, OmegaConf.to_container(OmegaConf.load(CONF_DIR / "student" / f"{args.student}.yaml")))
    student = build_student(spec, **student_keys)  # init: auto copies the teacher's blocks where widths match
    student.to(device).train()
    setup = {"spec": spec, "teacher": teacher, "student": student, "device": device, "target_rel_mse": None}
    setup |= {"table": table.to(device), "uncond": embeddings.negative_batch(args.batch).to(device)}
    if args.quantize:
        setup["target_rel_mse"] = _quantize_and_measure(args, setup)
    if args.attention_backend:
        teacher.set_attention_backend(args.attention_backend)
    if args.compile:  # diffusers' regional compile, as a hand-written script would use it
        teacher.compile_repeated_blocks(fullgraph=True)
        mode = {"mode": args.compile_mode} if args.compile_mode else {}
        cast(Any, student.transformer).compile_repeated_blocks(fullgraph=True, **mode)  # a diffusers model's
    params = [p for p in student.parameters() if p.requires_grad]
    fused = {"fused": True} if device.type == "cuda" else {}
    setup["optimizer"] = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=0.0, **fused)
    setup["scheduler"] = get_scheduler(
        "cosine", setup["optimizer"], num_warmup_steps=WARMUP, num_training_steps=args.steps
    )
    setup["params"] = params
    return setup


def draw(args, s: dict, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x_t, t and cond of a step, on the device: the framework's recipe for (seed, step, micro 0, rank 0)."""

    b, device, shift = args.batch, s["device"], s["spec"].flow_shift
    g = torch.Generator().manual_seed(mixed_seed(args.seed, step, 0, 0))
    idx = torch.randint(len(s["table"]), (b,), generator=g)
    shape = (b, 16, 1, args.latent_height, args.latent_width)
    x0, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    sigma = shift * (u := torch.rand(b, generator=g)) / (1 + (shift - 1) * u)
    x_t = (1 - sigma.view(-1, 1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1, 1) * noise
    if device.type == "cuda":
        x_t = x_t.pin_memory()
    return x_t.to(device, non_blocking=True), (sigma * 1000).to(device), s["table"][idx.to(device)]


def guided_target(s: dict, x_t: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    teacher = s["teacher"]
    with torch.no_grad():
        x = x_t.to(teacher.dtype)
        pred = teacher(
            hidden_states=torch.cat([x, x]),
            timestep=torch.cat([t, t]),
            encoder_hidden_states=torch.cat([cond, s["uncond"]]),
            return_dict=False,
        )[0]
        pred_cond, pred_uncond = pred.float().chunk(2)
        return pred_uncond + GUIDANCE * (pred_cond - pred_uncond)


def _quantize_and_measure(args, s: dict) -> float:
    """fp8 the teacher; return its targets' relative MSE against the bf16 ones on the first batch."""

    batch = draw(args, s, 0)
    reference = guided_target(s, *batch)
    quantize_expert(s["teacher"], args.quantize)
    return relative_mse(guided_target(s, *batch), reference)


def run_loop(args, s: dict) -> dict:
    """`args.steps` steps; times (events on CUDA, as the framework's loop) of those after `args.warmup`."""

    clock, (_, autocast), device = Clock(s["device"]), DTYPES[args.precision], s["device"]
    step_spans: list[tuple] = []  # clock marks, read once the clock has waited
    teacher_spans: list[tuple] = []
    losses: dict[int, float] = {}
    for step in range(args.steps):
        if step == args.warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = clock.mark()
        x_t, t, cond = draw(args, s, step)
        target = guided_target(s, x_t, t, cond)
        teacher_end = clock.mark()
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            pred, _ = s["student"](x_t, t, cond)
        loss = F.mse_loss(pred.float(), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(s["params"], MAX_NORM)
        s["optimizer"].step()
        s["optimizer"].zero_grad(set_to_none=True)
        s["scheduler"].step()
        if step >= args.warmup:
            step_spans.append((start, clock.mark()))
            teacher_spans.append((start, teacher_end))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            losses[step + 1] = loss.item()  # what a script logs; the same steps the framework logs at
    clock.wait()
    step_ms, teacher_ms = [clock.ms(*p) for p in step_spans], [clock.ms(*p) for p in teacher_spans]
    return {
        "samples_per_s": len(step_ms) * args.batch / (sum(step_ms) / 1e3),
        "step_ms_median": statistics.median(step_ms),
        "teacher_ms_median": statistics.median(teacher_ms),
        "student_ms_median": statistics.median(s - t for s, t in zip(step_ms, teacher_ms)),
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "loss_last": losses[args.steps],
        "losses": losses,
        "target_rel_mse_vs_bf16": s["target_rel_mse"],
    }
