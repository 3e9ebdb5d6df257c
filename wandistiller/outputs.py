"""What a run leaves in its folder: the student (and its EMA), the teacher-vs-student samples, metrics.json
and metrics_steps.jsonl, and the tracker's summary."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist


def millions(module: torch.nn.Module) -> float:
    return sum(p.numel() for p in module.parameters()) / 1e6


def finish(recipe, history: list[dict], ranks: list[dict]) -> dict:
    """Every rank's last step: the main rank writes the outputs and returns the run's summary."""
    run, cfg = recipe.run, recipe.cfg
    if recipe.is_main:
        save_student(run)
    grid = draw_samples(recipe)
    if not recipe.is_main:
        return ranks[recipe.topo.rank]
    summary = summarize(recipe, history, ranks)
    (recipe.run_dir / "metrics.json").write_text(json.dumps(summary, indent=2))
    with (recipe.run_dir / "metrics_steps.jsonl").open("a") as f:
        f.writelines(json.dumps(h) + "\n" for h in history)
    if grid is not None:
        run.tracker.log_image("samples", grid, step=cfg.trainer.max_steps)
    run.tracker.finish({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
    return summary


def save_student(run) -> None:
    """The trained student as a diffusers folder (`from_pretrained` loads it); with EMA, its EMA weights too."""
    run.student.transformer.save_pretrained(run.run_dir / "student", safe_serialization=True)
    if run.ema is not None:
        run.ema.copy_to(p for p in run.student.parameters() if p.requires_grad)
        run.student.transformer.save_pretrained(run.run_dir / "student_ema", safe_serialization=True)


def draw_samples(recipe) -> Path | None:
    """The teacher-vs-student grid: rank 0 (which always holds a teacher) draws the teacher's column, the
    main rank the student's. A sharded teacher needs every rank in its forwards."""
    from wandistiller.samples import save_grid, student_images, teacher_images

    cfg = recipe.cfg
    n, steps = cfg.trainer.sample_prompts, cfg.trainer.sample_steps
    if n <= 0:
        return None
    draws = recipe.topo.rank == 0 or recipe.placement.collective
    drawn = [teacher_images(recipe.teacher, recipe.embeddings, cfg.data, n, steps, cfg.seed) if draws else None]
    if recipe.topo.distributed:
        dist.broadcast_object_list(drawn, src=0)
    if not recipe.is_main:
        return None
    student = recipe.run.student
    student.eval()
    mine = student_images(recipe.spec, student.transformer, recipe.embeddings, cfg.data, n, steps, cfg.seed)
    return save_grid(drawn[0], mine, recipe.embeddings.prompts[:n], recipe.run_dir / "samples.png")


def summarize(recipe, history: list[dict], ranks: list[dict]) -> dict:
    cfg = recipe.cfg

    def median(key):
        values = [h[key] for h in history[1:] or history if key in h]  # the first step pays warm-up
        return statistics.median(values) if values else None

    peaks = {k: max(h[k] for h in history) for k in history[0] if k.endswith("_gib")} if history else {}
    students = sum(1 for r in ranks if "student" in r["role"])
    owner = next((r for r in ranks if "owner_idle_fraction" in r), {})
    return {
        "status": "completed",
        "teacher": cfg.teacher.name,
        "teacher_path": str(recipe.spec.path),
        "teacher_experts": len(recipe.spec.experts),
        "student_params_m": millions(recipe.run.student),
        "placement": recipe.placement.name,
        "precision": recipe.precision.name,
        "world_size": recipe.topo.world_size,
        "training_ranks": students,
        "batch_size": cfg.trainer.batch_size * cfg.trainer.grad_accum_steps * students,
        "steps_run": len(history),
        "final_step": history[-1]["step"] if history else None,
        "loss_first": history[0]["loss"] if history else None,
        "loss_last": history[-1]["loss"] if history else None,
        "samples_per_s_median": median("samples_per_s"),
        "step_ms_median": median("step_ms"),
        "step_ms_stdev": statistics.pstdev([h["step_ms"] for h in history]) if history else None,
        "teacher_ms_median": median("teacher_ms"),
        "student_ms_median": median("student_ms"),
        "copy_ms_median": median("copy_ms"),
        "owner_idle_fraction": owner.get("owner_idle_fraction"),
        "overrides": (recipe.prepared.sweep_point or {}).get("overrides"),
        **{f"{k}_max": v for k, v in peaks.items()},
        "ranks": ranks,
        "device": str(recipe.device),
        "hardware": {
            "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        },
        "wall_s": time.time() - recipe.started,
    }
