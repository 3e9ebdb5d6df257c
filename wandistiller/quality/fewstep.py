"""`python -m wandistiller.quality --fewstep`: students that sample in a few steps, against the teacher's 20.

Rows: the KD student (`method=kd`) sampled at 4 steps (the baseline a few-step method must beat), `method=trajectory` at
4, `method=dmd` at 4 (without and with its regression term) and at 1. Every row is `student=half` on the
teacher's images (`data=pocket_digits`) through `wandistiller.train`, and is judged on the same noises as the
teacher's row (20 UniPC steps, CFG):
prompt accuracy, FID, diversity relative to the teacher's (the mean pairwise distance of the judge's features
over each prompt's noises), network calls per image, latent MSE, the training run's peak host memory and wall
clock.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

from wandistiller.evaluation.metrics import heldout_reference
from wandistiller.pocket.classifier import load_classifier
from wandistiller.quality.compare import Settings, sample, score, seed_mean, train_student


@dataclass(frozen=True)
class Row:
    name: str
    overrides: tuple[str, ...]
    sample_steps: int | None = None  # None: the student's own K (a few-step method's `method.steps`)
    student: str | None = None  # another student than the comparison's (`student=lora`: the teacher + adapters)


ROWS = [
    Row("KD student at 4 steps", ("method=kd",), sample_steps=4),
    Row("trajectory, 4 steps", ("method=trajectory", "method.steps=4", "method.noises_per_prompt=1")),
    Row("dmd, 4 steps", ("method=dmd", "method.steps=4")),
    # DMD's regression term against its mode-seeking: the trajectory jump loss at a tenth of the weight.
    Row(
        "dmd + regression 0.1, 4 steps",
        ("method=dmd", "method.steps=4", "method.regression_weight=0.1", "method.noises_per_prompt=1"),
    ),
    Row("dmd, 1 step", ("method=dmd", "method.steps=1")),
]
# The LoRA student (student=lora, +experiment=pocket_lora's settings): the teacher itself plus rank-6 adapters
# (8.6% of its transformer), its fake score a second adapter set on it: `compare_fewstep(settings, work, LORA_ROWS)`.
LORA = (
    "student.rank=6",
    "method=dmd",
    "method.fake_score=lora",
    "method.lora_rank=16",
    "method.regression_weight=0.1",
    "method.noises_per_prompt=1",
    # The comparison judges the samples itself: no collapse watch (its figures were measured so).
    "hooks.collapse.every=0",
)
LORA_ROWS = [
    Row("LoRA student rank 6, dmd, 4 steps", (*LORA, "method.steps=4"), student="lora"),
    Row("LoRA student rank 6, dmd, 1 step", (*LORA, "method.steps=1"), student="lora"),
    # Guidance distillation: the same adapters trained on the teacher's CFG-combined target (method=kd), sampled
    # on the teacher's own scheduler at its 20 steps without CFG: half its network calls.
    Row(
        "LoRA student rank 6, kd, 20 steps without CFG",
        ("student.rank=6", "method=kd"),
        sample_steps=20,
        student="lora",
    ),
]
COLUMNS = ["calls", "prompt_accuracy", "fid", "diversity_ratio", "latent_mse", "peak_rss_gib", "train_s"]


def compare_fewstep(settings: Settings, work: Path, rows: list[Row] = ROWS, log=print) -> dict[str, list[dict]]:
    """{"teacher" and each row's name: [scores per seed]} (`diversity_ratio`: the row's over the teacher's)."""

    judge, reference, cache = load_classifier(), heldout_reference(), work / "cache"
    results: dict[str, list[dict]] = {name: [] for name in ["teacher", *(row.name for row in rows)]}
    for seed in settings.seeds:
        teacher = None
        for row in rows:
            started = time.perf_counter()
            run_dir = work / f"seed{seed}" / row.name.replace(" ", "_").replace(",", "")
            own = dataclasses.replace(settings, student=row.student) if row.student else settings
            summary = train_student(own, ["data=pocket_digits", *row.overrides], seed, run_dir, cache)
            if teacher is None:
                teacher = sample(run_dir, None, settings, seed)
                mine = score(teacher, teacher["latents"], judge, reference)
                results["teacher"].append(mine | {"calls": teacher["calls"], "diversity_ratio": 1.0})
            made = sample(run_dir, "student", settings, seed, row.sample_steps)
            scores = score(made, teacher["latents"], judge, reference) | {"calls": made["calls"]}
            scores["diversity_ratio"] = scores["diversity"] / results["teacher"][-1]["diversity"]
            scores["peak_rss_gib"] = summary.get("host_peak_rss_gib_max", math.nan)
            scores["train_s"] = summary.get("wall_s", time.perf_counter() - started)
            results[row.name].append(scores)
            log(f"seed {seed} {row.name}: " + "  ".join(f"{k} {v:.4g}" for k, v in scores.items()))
    return results


def targets(results: dict[str, list[dict]]) -> list[str]:
    """The few-step students' quality targets, each met or missed, from the means."""
    mark = lambda ok: "met" if ok else "MISSED"
    mean = {
        name: {k: seed_mean(runs, k) for k in ("prompt_accuracy", "fid", "diversity_ratio")}
        for name, runs in results.items()
    }
    teacher, kd = mean["teacher"], mean.get("KD student at 4 steps")
    lines = []
    four = [name for name in mean if name not in ("teacher", "KD student at 4 steps") and "4 steps" in name]
    if four:
        ratio = lambda n: mean[n]["prompt_accuracy"] / teacher["prompt_accuracy"]
        fid = lambda n: mean[n]["fid"] / teacher["fid"]
        meets = lambda n: ratio(n) >= 0.85 and fid(n) <= 1.5 and mean[n]["diversity_ratio"] >= 0.8
        # The best method that meets all three (accuracy alone would crown one that collapsed its diversity).
        best = max([n for n in four if meets(n)] or four, key=ratio)
        lines.append(
            f"- 4 steps (best: {best}): {ratio(best):.0%} of the teacher's accuracy (target >= 85%), FID "
            f"{fid(best):.2f}x (<= 1.5x), diversity {mean[best]['diversity_ratio']:.2f}x (>= 0.8x): "
            f"{mark(meets(best))}"
        )
        if kd is not None:  # the same 4-step student ("it beats ..."); the most accurate one's gain beside it
            gain = lambda n: (mean[n]["prompt_accuracy"] - kd["prompt_accuracy"]) * 100
            most = max(four, key=ratio)
            also = f" (the most accurate, {most}: +{gain(most):.1f})" if most != best else ""
            lines.append(
                f"- {best} beats the KD student at 4 steps by {gain(best):.1f} points (target >= 15): "
                f"{mark(gain(best) >= 15)}{also}"
            )
    one = [name for name in mean if "1 step" in name]
    if one:
        best = max(one, key=lambda n: mean[n]["prompt_accuracy"])
        kept = mean[best]["prompt_accuracy"] / teacher["prompt_accuracy"]
        lines.append(
            f"- 1 step (best: {best}): {kept:.0%} of the teacher's accuracy (target >= 60%, stretch "
            f"70%): {mark(kept >= 0.6)}"
        )
    return lines


def lora_targets(results: dict[str, list[dict]], pair: bool = False) -> list[str]:
    """The targets of the LoRA rows present in `results` (each met or missed, from the means over
    seeds, with the seed count): 4 steps >= 95% of the teacher's accuracy, FID <= 1.2x, diversity >= 0.85x (a
    two-expert pair, `pair`: >= 90% of its teacher's accuracy); 1 step >= 85%; kd >= 97% and FID <= 1.1x in
    half the teacher's calls."""
    mark = lambda ok: "met" if ok else "MISSED"
    teacher = {k: seed_mean(results["teacher"], k) for k in ("prompt_accuracy", "fid", "calls")}
    lines = []
    for name, runs in results.items():
        if name == "teacher" or not runs:
            continue
        mine = {k: seed_mean(runs, k) for k in ("prompt_accuracy", "fid", "diversity_ratio", "calls")}
        kept, fid, diversity = (
            mine["prompt_accuracy"] / teacher["prompt_accuracy"],
            mine["fid"] / teacher["fid"],
            mine["diversity_ratio"],
        )
        seeds = f"{len(runs)} seed{'s' if len(runs) > 1 else ''}"
        if "4 steps" in name and pair:
            lines.append(
                f"- {name} ({seeds}): {kept:.0%} of the pair teacher's accuracy (target >= 90%): {mark(kept >= 0.9)}"
            )
        elif "4 steps" in name:
            ok = kept >= 0.95 and fid <= 1.2 and diversity >= 0.85
            lines.append(
                f"- {name} ({seeds}): {kept:.0%} of the teacher's accuracy (target >= 95%), FID {fid:.2f}x "
                f"(<= 1.2x), diversity {diversity:.2f}x (>= 0.85x): {mark(ok)}"
            )
        elif "1 step" in name:
            lines.append(
                f"- {name} ({seeds}): {kept:.0%} of the teacher's accuracy (target >= 85%): {mark(kept >= 0.85)}"
            )
        elif "kd" in name:
            ok = kept >= 0.97 and fid <= 1.1 and mine["calls"] * 2 <= teacher["calls"]
            lines.append(
                f"- {name} ({seeds}): {mine['calls']:.0f} calls against {teacher['calls']:.0f}, "
                f"{kept:.0%} of the teacher's accuracy (target >= 97%), FID {fid:.2f}x (<= 1.1x): "
                f"{mark(ok)}"
            )
    return lines
