"""`python -m wandistiller.quality --teacher pocket_video` (or `pocket_video_moe`): students of the pocket video
teacher, judged on clips (docs/QUALITY.md, "Video").

Rows (issue 40): the teacher (20 UniPC steps, CFG); the KD student at 20 and at 4 UniPC steps (the baseline the
few-step methods must clearly beat); trajectory at 4; dmd + regression at 4 and dmd at 1; the LoRA student (dmd) at 4
and 1, and LoRA kd (the teacher's scheduler at 20 steps without CFG). Every row trains through `wandistiller.train`
on clips (`data.latent_frames=5`: 9 frames of 32x32) and is judged on the teacher's noises: network calls, per-frame
accuracy, motion accuracy, motion ratio (its speed over the teacher's), temporal consistency, the clip Fréchet
distance and diversity relative to the teacher's (evaluation/clips.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch

from wandistiller.core.errors import UserError
from wandistiller.evaluation.clips import (
    clip_features,
    frame_features,
    heldout_clip_reference,
    load_frame_judge,
    pocket_clip_scores,
)
from wandistiller.quality.compare import VIDEO_TEACHERS, Settings, sample, seed_mean, train_student
from wandistiller.quality.fewstep import LORA, Row

__all__ = ["VIDEO_TEACHERS", "chosen", "compare_video", "targets"]
# Every row's clips: the video teacher's 5 latent frames (9 frames). A KD row learns from the teacher's own clips
# (x0: its sampled latents); trajectory and dmd read prompts alone (they sample the teacher themselves).
CLIPS = ("data.latent_frames=5",)
BATCH = 4  # clips a step: 80 tokens each where an image is 16 (the +experiment=pocket_video* batch)
TEACHER_CLIPS = ("data=teacher_latents", "method=kd")
FEW = ("data=static_prompts",)
ROWS = [
    Row("KD student at 20 steps", TEACHER_CLIPS, sample_steps=20),
    Row("KD student at 4 steps", TEACHER_CLIPS, sample_steps=4),
    Row("trajectory, 4 steps", (*FEW, "method=trajectory", "method.steps=4", "method.noises_per_prompt=1")),
    Row(
        "dmd + regression 0.1, 4 steps",
        (*FEW, "method=dmd", "method.steps=4", "method.regression_weight=0.1", "method.noises_per_prompt=1"),
    ),
    Row("dmd, 1 step", (*FEW, "method=dmd", "method.steps=1")),
    Row("LoRA student rank 6, dmd, 4 steps", (*FEW, *LORA, "method.steps=4"), student="lora"),
    Row("LoRA student rank 6, dmd, 1 step", (*FEW, *LORA, "method.steps=1"), student="lora"),
    Row("LoRA student rank 6, kd, 20 steps without CFG", (*TEACHER_CLIPS, "student.rank=6"), 20, "lora"),
]
COLUMNS = [
    "calls",
    "frame_accuracy",
    "motion_accuracy",
    "motion_ratio",
    "temporal_consistency",
    "clip_fd",
    "diversity_ratio",
    "latent_mse",
    "train_s",
]


def chosen(words: list[str] | None) -> list[Row]:
    """The rows whose name holds one of `words` (case-insensitive; None: every row); none is one line."""
    if not words:
        return ROWS
    rows = [row for row in ROWS if any(w.lower() in row.name.lower() for w in words)]
    if not rows:
        names = "; ".join(row.name for row in ROWS)
        raise UserError(f"--rows {' '.join(words)}: no row's name holds these words; the rows: {names}")
    return rows


def score_clips(made: dict, teacher_latents: torch.Tensor, judge, reference) -> dict:
    """A row's clip figures (nan where withheld: clip_fd from too few clips, diversity from one noise a prompt)."""
    scores = pocket_clip_scores(made["images"], made["prompts"], judge, reference)
    keys = ("frame_accuracy", "motion_accuracy", "temporal_consistency", "speed", "clip_fd", "diversity")
    return {k: scores.get(k, math.nan) for k in keys} | {
        "latent_mse": float(((made["latents"] - teacher_latents) ** 2).mean()),
        "calls": made["calls"],
        "s_per_image": made["s_per_image"],
    }


def compare_video(settings: Settings, work: Path, rows: list[Row] = ROWS, log=print) -> dict[str, list[dict]]:
    """{"teacher" and each row's name: [scores per seed]}: `motion_ratio` and `diversity_ratio` over the teacher's
    of the same seed (the same noises)."""
    judge = load_frame_judge()
    reference, cache = clip_features(frame_features(judge, heldout_clip_reference())), work / "cache"
    results: dict[str, list[dict]] = {name: [] for name in ["teacher", *(row.name for row in rows)]}
    for seed in settings.seeds:
        teacher = None
        trained: dict[tuple, tuple[Path, dict]] = {}  # rows that differ only in their sampling share one student
        for row in rows:
            started = time.perf_counter()
            training = (row.student, row.overrides)
            if training not in trained:
                run_dir = work / f"seed{seed}" / row.name.replace(" ", "_").replace(",", "")
                own = dataclasses.replace(settings, student=row.student) if row.student else settings
                trained[training] = run_dir, train_student(own, [*CLIPS, *row.overrides], seed, run_dir, cache)
            run_dir, summary = trained[training]
            if teacher is None:
                teacher = sample(run_dir, None, settings, seed)
                mine = score_clips(teacher, teacher["latents"], judge, reference)
                same = {"motion_ratio": 1.0, "diversity_ratio": 1.0 if mine["diversity"] > 0 else math.nan}
                results["teacher"].append(mine | same)  # nan > 0 is False: withheld stays withheld
            first = results["teacher"][-1]
            made = sample(run_dir, "student", settings, seed, row.sample_steps)
            scores = score_clips(made, teacher["latents"], judge, reference)
            scores["motion_ratio"] = scores["speed"] / first["speed"] if first["speed"] > 0 else math.nan
            scores["diversity_ratio"] = scores["diversity"] / first["diversity"] if first["diversity"] else math.nan
            scores["train_s"] = summary.get("wall_s", time.perf_counter() - started)
            results[row.name].append(scores)
            log(f"seed {seed} {row.name}: " + "  ".join(f"{k} {v:.4g}" for k, v in scores.items()))
    return results


def targets(results: dict[str, list[dict]]) -> list[str]:
    """Issue 40's targets, each met or missed (or not run), from the means over seeds."""
    mark = lambda ok: "met" if ok else "MISSED"
    keys = ("frame_accuracy", "motion_accuracy", "motion_ratio", "clip_fd")
    mean = {name: {k: seed_mean(runs, k) for k in keys} for name, runs in results.items() if runs}
    teacher = mean["teacher"]
    lines = [
        f"- the teacher: {teacher['frame_accuracy']:.1%} per-frame accuracy (target >= 90%), "
        f"{teacher['motion_accuracy']:.1%} motion accuracy (>= 90%): "
        f"{mark(teacher['frame_accuracy'] >= 0.9 and teacher['motion_accuracy'] >= 0.9)}"
    ]
    kept = lambda n, k: mean[n][k] / max(teacher[k], 1e-9)
    lora = "LoRA student rank 6, dmd, 4 steps"
    if lora in mean:
        ok = (
            kept(lora, "frame_accuracy") >= 0.95
            and kept(lora, "motion_accuracy") >= 0.95
            and 0.9 <= mean[lora]["motion_ratio"] <= 1.1
            and mean[lora]["clip_fd"] <= 1.2 * teacher["clip_fd"]
        )
        lines.append(
            f"- {lora}: {kept(lora, 'frame_accuracy'):.0%} of the teacher's per-frame accuracy and "
            f"{kept(lora, 'motion_accuracy'):.0%} of its motion accuracy (>= 95% each), motion ratio "
            f"{mean[lora]['motion_ratio']:.2f} (0.9-1.1), clip FD {kept(lora, 'clip_fd'):.2f}x (<= 1.2x): {mark(ok)}"
        )
    cut = "dmd + regression 0.1, 4 steps"
    if cut in mean:
        ok = (
            kept(cut, "frame_accuracy") >= 0.9
            and kept(cut, "motion_accuracy") >= 0.9
            and mean[cut]["motion_ratio"] >= 0.85
        )
        lines.append(
            f"- cut student, {cut}: {kept(cut, 'frame_accuracy'):.0%} of the teacher's per-frame accuracy and "
            f"{kept(cut, 'motion_accuracy'):.0%} of its motion accuracy (>= 90% each), motion ratio "
            f"{mean[cut]['motion_ratio']:.2f} (>= 0.85): {mark(ok)}"
        )
    return lines
