"""`python -m wandistiller.quality --stacking`: a 4-step LoRA student beside what users load with it (issue 44).

Two questions, each a few rows on the same noises as the teacher's (20 UniPC steps, CFG):
- **Schedules**: the `+experiment=pocket_lora` student (trained at diffusers' Euler sigmas, the default) sampled at
  its trained sigmas and at ComfyUI's `simple` ones at the same shift (what a KSampler with `simple` gives it), and
  a student trained at `method.schedule=simple` sampled at those.
- **Stacking**: a style LoRA of the teacher (`pocket/style.py`: dim digits) on the teacher at its 20 steps
  (`teacher.lora=style`); the plain teacher's 4-step LoRA with the style LoRA stacked on it at sampling; and the
  4-step LoRA distilled from the styled teacher.

Columns: prompt accuracy (the judge reads every image scaled to its peak brightness, so content and style are
measured apart), `style_brightness` (the digit's brightness: pocket/style.py `digit_brightness`), `style_kept` (the
row's brightness change from the plain teacher's, over the styled teacher's change), FID (of the scaled images),
network calls per image. A run already finished in `--work` is reused, not trained again.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

from wandistiller.evaluation.metrics import heldout_reference
from wandistiller.pocket.classifier import load_classifier
from wandistiller.pocket.style import STYLE_LORA_FILE, digit_brightness, normalised
from wandistiller.quality.compare import Settings, sample, score, seed_mean, train_student
from wandistiller.quality.fewstep import LORA, LORA_ROWS
from wandistiller.teacher.fewstep import Schedule

# The students this comparison trains (a run folder each per seed): +experiment=pocket_lora's 4-step LoRA student.
PLAIN, SIMPLE, STYLED = "plain", "simple", "styled"
# The styled teacher's student: at pocket_lora's settings it keeps 90% of the styled teacher's prompt accuracy
# (issue 44 asks 95%). A larger rank and regression term each help (rank 16 + regression 0.3: 94%), a larger rank
# alone no further (rank 32: 94%); twice the learning rate closes the gap (docs/QUALITY.md, "Schedules and
# stacking"). What a user distilling a fine-tuned teacher should start from.
FINE_TUNED_TEACHER = ("student.rank=16", "method.regression_weight=0.3", "trainer.optimizer.lr=2e-3")


def _with(overrides: tuple[str, ...], changed: tuple[str, ...]) -> tuple[str, ...]:
    """`overrides` with the keys `changed` sets replaced by its values."""
    keys = {o.split("=", 1)[0] for o in changed}
    return (*(o for o in overrides if o.split("=", 1)[0] not in keys), *changed)


TRAININGS = {
    PLAIN: (*LORA, "method.steps=4"),
    SIMPLE: (*LORA, "method.steps=4", "method.schedule=simple"),
    STYLED: _with((*LORA, "method.steps=4"), FINE_TUNED_TEACHER),  # + teacher.lora=[the style LoRA]
}
# The plain student's folder is the few-step comparison's LoRA row's (the same training): either reuses the other's.
FOLDERS = {PLAIN: LORA_ROWS[0].name.replace(" ", "_").replace(",", ""), SIMPLE: "lora4_simple", STYLED: "lora4_styled"}
TEACHER, STYLED_TEACHER = "teacher, 20 steps", "styled teacher (teacher.lora=style), 20 steps"


@dataclass(frozen=True)
class Row:
    name: str
    run: str  # which training's run folder it samples (TRAININGS)
    student: bool = True  # False: that run's teacher
    schedule: str | None = None  # sampled at ComfyUI's schedule of this name (the teacher's shift), not the trained
    stacked: bool = False  # the style LoRA stacked on it at sampling (on the teacher: the styled teacher itself)


ROWS = [
    Row("LoRA 4 steps, at its trained sigmas (euler)", PLAIN),
    Row("LoRA 4 steps, at ComfyUI simple sigmas", PLAIN, schedule="simple"),
    Row("LoRA trained at simple, 4 steps at simple", SIMPLE),
    Row(STYLED_TEACHER, PLAIN, student=False, stacked=True),  # the teacher with the style merged: teacher.lora's
    Row("plain LoRA 4 steps + style LoRA stacked", PLAIN, stacked=True),
    Row("LoRA distilled from the styled teacher, 4 steps", STYLED),
]
COLUMNS = ["calls", "prompt_accuracy", "style_brightness", "style_kept", "fid"]


def chosen(words: list[str] | None) -> list[Row]:
    """The rows whose name holds one of `words` (all without words)."""
    return [r for r in ROWS if not words or any(w.lower() in r.name.lower() for w in words)]


def _trained(settings: Settings, run: str, seed: int, work: Path, style: Path) -> Path:
    """The run folder of training `run` at `seed`: trained now, or a finished one taken as it is. Always through
    `train_student` (`trainer.resume=auto`), which refuses a folder trained under other settings in one line: a
    `--work` from a run at other `--steps` or student settings is never sampled as if it were this one's."""
    run_dir = work / f"seed{seed}" / FOLDERS[run]
    extra = [f"teacher.lora=[{style}]"] if run == STYLED else []
    lora = dataclasses.replace(settings, student="lora")
    train_student(lora, ["data=pocket_digits", *TRAININGS[run], *extra], seed, run_dir, work / "cache")
    return run_dir


def _scores(made: dict, teacher_latents, judge, reference) -> dict:
    plain = dict(made, images=normalised(made["images"]))  # the judge reads the digit, whatever its brightness
    out = score(plain, teacher_latents, judge, reference) | {"calls": made["calls"]}
    return out | {"style_brightness": float(digit_brightness(made["images"]).mean())}


def compare_stacking(
    settings: Settings, work: Path, rows: list[Row] = ROWS, style: Path = STYLE_LORA_FILE, log=print
) -> dict[str, list[dict]]:
    """{"teacher, 20 steps" and each row's name: [scores per seed]}; `style_kept`: the row's brightness change
    from the plain teacher's, over the styled teacher's change (where the styled teacher's row ran)."""
    judge, reference = load_classifier(), heldout_reference()
    results: dict[str, list[dict]] = {name: [] for name in [TEACHER, *(r.name for r in rows)]}
    for seed in settings.seeds:
        started, runs = time.perf_counter(), {}
        for row in rows:
            if row.run not in runs:
                runs[row.run] = _trained(settings, row.run, seed, work, style)
        # The plain teacher's row samples a run of the plain teacher: the styled run's teacher has the style merged.
        plain = next((d for run, d in runs.items() if run != STYLED), None)
        teacher = sample(plain or _trained(settings, PLAIN, seed, work, style), None, settings, seed)
        results[TEACHER].append(_scores(teacher, teacher["latents"], judge, reference))
        seen = {TEACHER: results[TEACHER][-1]}
        for row in rows:
            made = sample(
                runs[row.run],
                "student" if row.student else None,
                settings,
                seed,
                schedule=Schedule(row.schedule) if row.schedule else None,
                loras=(style,) if row.stacked else (),
            )
            seen[row.name] = _scores(made, teacher["latents"], judge, reference)
        base, styled = seen[TEACHER]["style_brightness"], seen.get(STYLED_TEACHER, {}).get("style_brightness")
        for name, scores in seen.items():
            if styled is not None and abs(styled - base) > 1e-3:
                scores["style_kept"] = (scores["style_brightness"] - base) / (styled - base)
            if name != TEACHER:
                results[name].append(scores)
            log(f"seed {seed} {name}: " + "  ".join(f"{k} {v:.4g}" for k, v in scores.items() if k in COLUMNS))
        log(f"seed {seed}: {time.perf_counter() - started:.0f} s")
    return results


def targets(results: dict[str, list[dict]]) -> list[str]:
    """Issue 44's targets of the rows present, each met or missed, from the means over seeds."""
    mark = lambda ok: "met" if ok else "MISSED"
    mean = {name: {k: seed_mean(runs, k) for k in COLUMNS} for name, runs in results.items() if runs}
    lines = []
    trained, simple = ROWS[0].name, ROWS[1].name
    if trained in mean and simple in mean:
        a, b = mean[trained]["prompt_accuracy"], mean[simple]["prompt_accuracy"]
        lines.append(
            f"- the 4-step LoRA at its trained sigmas {a:.1%} against {b:.1%} at ComfyUI's simple ones "
            f"(target: at least as well): {mark(a >= b)}"
        )
    distilled = ROWS[5].name
    if STYLED_TEACHER in mean and distilled in mean:
        kept = mean[distilled]["style_kept"]
        ratio = mean[distilled]["prompt_accuracy"] / mean[STYLED_TEACHER]["prompt_accuracy"]
        ok = not math.isnan(kept) and kept >= 0.9 and ratio >= 0.95
        lines.append(
            f"- the 4-step LoRA distilled from the styled teacher keeps {kept:.0%} of its style (target >= 90%) "
            f"and {ratio:.0%} of its prompt accuracy (target >= 95%): {mark(ok)}"
        )
    stacked = ROWS[4].name
    if stacked in mean:
        lines.append(
            f"- the plain 4-step LoRA stacked with the style LoRA keeps {mean[stacked]['style_kept']:.0%} of the "
            f"style at {mean[stacked]['prompt_accuracy']:.1%} prompt accuracy (measured, no target)"
        )
    return lines
