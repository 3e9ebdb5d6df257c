"""What a run leaves in its folder: the student (and its EMA), metrics.json (with what the hooks add at the end: the
final sample grid, the evaluation), the student pipeline, and the loggers' summary."""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from wandistiller.core.files import replace_folder, write_in_run
from wandistiller.core.stopping import Signalled, end_of_run_stopped
from wandistiller.data.validation import recorded_rows, save_loss_plot
from wandistiller.recipe.context import RunContext
from wandistiller.recipe.hooks.base import Hook
from wandistiller.recipe.methods import card_phrases
from wandistiller.state.checkpoint import teacher_digest, tensors_digest
from wandistiller.state.export import run_pipeline

log = logging.getLogger("wandistiller")


def millions(module: torch.nn.Module) -> float:
    return sum(p.numel() for p in module.parameters()) / 1e6


def finish(ctx: RunContext, run, history: list[dict], ranks: list[dict]) -> dict:
    """The main rank's last step: the outputs written, the run's summary returned."""
    save_student(run)
    drop_earlier_judgements(ctx.run_dir)  # before the hooks below write this student's
    rows = recorded_rows(ctx.run_dir)  # what the monitor appended, every segment of the run
    save_loss_plot(ctx.run_dir)  # also for a run too short to validate: every run leaves its curve
    summary = summarize(ctx, run, whole_run(rows, history), ranks, segment=history)
    summary |= validation_summary(rows)
    ending = [h for h in run.hooks if isinstance(h, Hook)]
    stopped: Signalled | None = None
    for i, hook in enumerate(ending):  # the last sample grid (hooks.samples); the evaluation (hooks.evaluate): means
        try:
            summary |= hook.at_end(run)
        except Signalled as e:  # Ctrl-C in the evaluation: training is done, so what it made is still written
            stopped, skipped = e, [_hook_name(h) for h in ending[i:]]
            break
    write_in_run(ctx.run_dir, "metrics.json", json.dumps(summary, indent=2))  # a sweep report never reads half
    # after metrics.json: its model card quotes them
    run_pipeline(ctx.run_dir, Path(ctx.spec.path), card_phrases(), ctx.spec)
    run.tracker.finish({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
    if stopped is not None:
        raise end_of_run_stopped(stopped.signum, skipped, ctx.run_dir)
    return summary


def _hook_name(hook: Hook) -> str:
    """`hooks.evaluate`: a hook by its option's name (its module's), as the user drops it."""
    return f"hooks.{type(hook).__module__.rsplit('.', 1)[-1]}"


def save_student(run) -> None:
    """The trained student as a diffusers folder (`from_pretrained` loads it); with EMA, its EMA weights too. Each
    is written whole into a new folder that then takes the old one's place: a resumed (received) run's
    `student/` that is a link, or holds hard links, is replaced, never written through."""
    save = lambda folder: run.student.transformer.save_pretrained(folder, safe_serialization=True)
    if hasattr(run.student, "save"):  # a LoRA student (student/lora.py): its adapters, as diffusers writes them
        save = lambda folder: run.student.save(folder, run.teacher)
    replace_folder(run.run_dir, "student", save)
    if run.ema is not None:
        run.ema.copy_to(p for p in run.student.parameters() if p.requires_grad)
        replace_folder(run.run_dir, "student_ema", save)


def of_the_final_student(name: str) -> bool:
    """Whether a file at a run's top judges its final student: the end-of-run grid (`samples.png`/`.gif`), its
    evaluation at the run's own settings (`eval.json`/`.png`/`.gif`) or at others (`eval_steps20.json`, …:
    evaluate.result_stem); a checkpoint's (`eval_best…`, `eval_step_…`) judges that checkpoint, which stays."""
    stem, _, ext = name.rpartition(".")
    if ext not in ("json", "png", "gif"):
        return False
    if stem == "samples":
        return True
    first = stem.split("_")[1] if stem.startswith("eval_") else None
    return stem == "eval" or (first is not None and first not in ("best", "step"))


def drop_earlier_judgements(run_dir: str | os.PathLike) -> None:
    """An earlier launch's figures and grids of the student this launch replaced: gone with it (a resume without
    the hooks, `~hooks.evaluate`, left step 3's eval.json beside step 5's student, naming no step)."""
    dropped = []
    for path in sorted(Path(run_dir).iterdir()):
        if of_the_final_student(path.name) and not path.is_dir():
            path.unlink()  # a link: the link alone
            dropped.append(path.name)
    if dropped:
        log.info("removed %s: they judged the student this launch replaced", ", ".join(dropped))


def whole_run(rows: list[dict], history: list[dict]) -> list[dict]:
    """Every training step of the run, the segments before a resume included (validation rows aside);
    this segment's `history` if nothing was recorded."""
    if not rows:
        return history
    steps = {r["step"]: r for r in rows if "loss" in r}  # a step redone after a resume: its last record
    # Steps past this segment's last were measured by a killed segment and rolled back to a checkpoint.
    last = history[-1]["step"] if history else max(steps, default=0)
    return [steps[k] for k in sorted(steps) if k <= last] or history


def validation_summary(rows: list[dict]) -> dict:
    """The last and the best held-out loss of the run (metrics_steps.jsonl's validation rows)."""
    val = [r for r in rows if "val/loss" in r]
    if not val:
        return {}
    return {"val_loss_last": val[-1]["val/loss"], "val_loss_best": min(r["val/loss"] for r in val)}


def teacher_identity(ctx: RunContext) -> dict:
    """The teacher by what was loaded: the Hub id or folder given, the folder read, and its shape (a
    config option's name alone, e.g. "tiny", says nothing once teacher.path points elsewhere)."""
    spec, config = ctx.spec, ctx.spec.transformer_config
    keys = ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim", "text_dim", "in_channels")
    return {
        "teacher": str(ctx.teacher_cfg.path),
        "teacher_config_name": ctx.teacher_cfg.name,
        "teacher_path": str(spec.path),
        "teacher_experts": len(spec.experts),
        "teacher_shape": {k: config.get(k) for k in keys},
        "teacher_digest": teacher_digest(spec),  # eval and generate compare the teacher they are given with it
        "teacher_tensors_digest": tensors_digest(spec),  # every tensor sampled: compared first where recorded
    } | ({"teacher_loras": [lora.record() for lora in spec.loras]} if spec.loras else {})  # a fine-tuned teacher


def summarize(ctx: RunContext, run, history: list[dict], ranks: list[dict], segment: Sequence[dict] = ()) -> dict:
    t = ctx.trainer_cfg

    def median(key):
        values = [h[key] for h in history[1:] or history if key in h]  # the first step pays warm-up
        return statistics.median(values) if values else None

    peaks = {k: max(h[k] for h in history) for k in history[0] if k.endswith("_gib")} if history else {}
    students = sum(1 for r in ranks if "student" in r["role"])
    owner = next((r for r in ranks if "owner_idle_fraction" in r), {})
    return {
        "status": "completed",
        **teacher_identity(ctx),
        "student_params_m": millions(run.student),
        "method": run.method.name,  # what trained the student (method=), and its own steps K (null: kd's)
        "student_steps": run.method.steps,
        "placement": ctx.placement.name,
        "precision": ctx.precision.name,
        "world_size": ctx.topo.world_size,
        "training_ranks": students,
        "batch_size": t.batch_size * t.grad_accum_steps * students,
        "steps_run": len(history),  # the whole run's, resumed segments included
        "steps_this_segment": len(segment),
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
        "overrides": (ctx.sweep_point or {}).get("overrides") or ctx.overrides,
        **{f"{k}_max": v for k, v in peaks.items()},
        "ranks": ranks,
        "device": str(ctx.device),
        "hardware": {
            "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        },
        "wall_s": (wall := time.time() - ctx.started),
        # This process's samples over its whole wall time (loading, precompute, the end-of-run work included): what a
        # user waited for, beside the median step's rate.
        "samples_this_segment": (samples := len(segment) * t.batch_size * t.grad_accum_steps * students),
        "samples_per_s_overall": samples / wall if wall > 0 else None,
    }
