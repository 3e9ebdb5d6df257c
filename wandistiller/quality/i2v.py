"""`python -m wandistiller.quality --teacher pocket_i2v` (or `pocket_i2v_moe`, Wan 2.2 I2V A14B's layout): students of
the pocket image-to-video teacher, judged on clips continued from a given first frame (docs/QUALITY.md, "Image to
video").

Every sample starts from an image the teacher never saw: the first frame of a held-out digit rendered as the prompt
asks (its colour, and where a clip moving that way starts), the same images and noises for every row. Rows: the
teacher (20 UniPC steps, CFG); the LoRA student (dmd, 4 steps; on the pair, one adapter set per expert); the cut
student (dmd, 4 steps; and with dmd's regression term on the teacher's ODE from each prompt's image). Columns:
identity held (the frame judge reads the given digit and colour on every frame), motion accuracy, motion ratio (its
speed over the teacher's), first-frame PSNR against the given image, clip FD.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

import torch

from wandistiller.core.errors import UserError
from wandistiller.evaluation.clips import (
    clip_features,
    first_frame_psnr,
    frame_features,
    heldout_clip_reference,
    load_frame_judge,
    pocket_clip_scores,
)
from wandistiller.pocket import I2V_PAIRS_DIR
from wandistiller.pocket.i2v import LATENT_FRAMES, clips_for
from wandistiller.quality import compare
from wandistiller.quality.compare import I2V_TEACHERS, Settings, prompt_set, seed_mean, train_student
from wandistiller.quality.fewstep import Row

__all__ = ["I2V_TEACHERS", "chosen", "compare_i2v", "targets"]
STEPS = 600  # each student's training steps (+experiment=pocket_i2v_lora's): about 10 minutes here
# Every row's data: the shipped (first frame, prompt) pairs, clips of the teacher's 5 latent frames.
PAIRS = ("data=image_folder", f"data.dataset={I2V_PAIRS_DIR}", f"data.latent_frames={LATENT_FRAMES}")
DISTILLED = ("method=dmd", "method.steps=4", "hooks.collapse.every=0")  # the comparison judges the samples itself
LORA = ("student.rank=6", "method.fake_score=lora", "method.lora_rank=16")
ROWS = [
    Row("LoRA student rank 6, dmd, 4 steps", (*PAIRS, *DISTILLED, *LORA), student="lora"),
    Row("cut student, dmd, 4 steps", (*PAIRS, *DISTILLED)),
    # dmd's regression term on the teacher's ODE, sampled from each prompt's image (the video table's best cut row).
    Row(
        "cut student, dmd + regression 0.1, 4 steps",
        (*PAIRS, *DISTILLED, "method.regression_weight=0.1", "method.noises_per_prompt=1"),
    ),
]
COLUMNS = ["calls", "identity_held", "motion_accuracy", "motion_ratio", "first_frame_psnr", "clip_fd", "train_s"]
LORA_ROW = ROWS[0].name


def chosen(words: list[str] | None) -> list[Row]:
    """The rows whose name holds one of `words` (case-insensitive; None: every row); none is one line."""
    if not words:
        return ROWS
    rows = [row for row in ROWS if any(w.lower() in row.name.lower() for w in words)]
    if not rows:
        raise UserError(
            f"--rows {' '.join(words)}: no row's name holds these words; the rows: " + "; ".join(r.name for r in ROWS)
        )
    return rows


def given_frames(prompts: list[str], seed: int, per_prompt: int) -> list[torch.Tensor]:
    """Per noise k, the first frames [P, 3, 32, 32] (in [0, 1]) given with the prompts: held-out digits (the test
    split), drawn with seed * 1000 + k, as each prompt asks."""
    return [clips_for(prompts, "test", seed * 1000 + k)[:, 0] for k in range(per_prompt)]


def sample(run_dir: Path, source: str | None, settings: Settings, seed: int) -> dict:
    """compare.sample's clips of the teacher (source None) or the run's student, each noise k from its prompts'
    given first frames k (`given_frames`), with those frames beside them."""
    frames = given_frames(prompt_set(settings), seed, settings.per_prompt)
    return compare.sample(run_dir, source, settings, seed, first_frames=frames) | {"given": torch.cat(frames)}


def score_clips(made: dict, judge, reference) -> dict:
    """A row's figures: identity held, motion, first-frame PSNR, clip FD (nan where withheld)."""
    scores = pocket_clip_scores(made["images"], made["prompts"], judge, reference)
    return {
        "identity_held": scores["frame_accuracy"],
        "motion_accuracy": scores["motion_accuracy"],
        "speed": scores["speed"],
        "first_frame_psnr": statistics.fmean(first_frame_psnr(made["images"], made["given"])),
        "clip_fd": scores.get("clip_fd", math.nan),
        "calls": made["calls"],
        "s_per_image": made["s_per_image"],
    }


def compare_i2v(settings: Settings, work: Path, rows: list[Row] = ROWS, log=print) -> dict[str, list[dict]]:
    """{"teacher" and each row's name: [scores per seed]}; `motion_ratio` over the teacher's of the same seed."""
    judge = load_frame_judge()
    reference, cache = clip_features(frame_features(judge, heldout_clip_reference())), work / "cache"
    results: dict[str, list[dict]] = {name: [] for name in ["teacher", *(row.name for row in rows)]}
    for seed in settings.seeds:
        teacher = None
        for row in rows:
            run_dir = work / f"seed{seed}" / row.name.replace(" ", "_").replace(",", "")
            own = dataclasses.replace(settings, student=row.student or settings.student)
            summary = train_student(own, list(row.overrides), seed, run_dir, cache)
            if teacher is None:
                teacher = score_clips(sample(run_dir, None, settings, seed), judge, reference)
                results["teacher"].append(teacher | {"motion_ratio": 1.0})  # trained by no one: no train_s
            scores = score_clips(sample(run_dir, "student", settings, seed), judge, reference)
            scores["motion_ratio"] = scores["speed"] / teacher["speed"] if teacher["speed"] > 0 else math.nan
            scores["train_s"] = summary.get("wall_s", math.nan)
            results[row.name].append(scores)
            log(f"seed {seed} {row.name}: " + "  ".join(f"{k} {v:.4g}" for k, v in scores.items()))
    return results


def targets(results: dict[str, list[dict]], pair: bool) -> list[str]:
    """Issue 42's targets, each met or missed, from the means over seeds: the teacher's, and its 4-step LoRA
    student's (`pair`: the A14B-layout pair's, at least 90% of the teacher on both figures)."""
    mark = lambda ok: "met" if ok else "MISSED"
    keys = ("identity_held", "motion_accuracy", "motion_ratio", "first_frame_psnr")
    mean = {name: {k: seed_mean(runs, k) for k in keys} for name, runs in results.items() if runs}
    teacher = mean["teacher"]
    lines = [
        f"- the teacher: {teacher['identity_held']:.1%} identity held (target >= 90%), "
        f"{teacher['motion_accuracy']:.1%} motion accuracy (>= 90%), first-frame PSNR "
        f"{teacher['first_frame_psnr']:.1f} dB: "
        f"{mark(teacher['identity_held'] >= 0.9 and teacher['motion_accuracy'] >= 0.9)}"
    ]
    if LORA_ROW in mean:
        kept = {k: mean[LORA_ROW][k] / max(teacher[k], 1e-9) for k in ("identity_held", "motion_accuracy")}
        ratio = mean[LORA_ROW]["motion_ratio"]
        least = 0.9 if pair else 0.95
        ok = min(kept.values()) >= least and (pair or 0.9 <= ratio <= 1.1)
        lines.append(
            f"- {'the A14B-layout pair, ' if pair else ''}{LORA_ROW}: {kept['identity_held']:.0%} of the teacher's "
            f"identity held and {kept['motion_accuracy']:.0%} of its motion accuracy (>= {least:.0%} each), motion "
            f"ratio {ratio:.2f}{'' if pair else ' (0.9-1.1)'}: {mark(ok)}"
        )
    return lines
