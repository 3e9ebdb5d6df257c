"""`python -m wandistiller.quality --compression`: what a student keeps of the pocket teacher as it shrinks.

Rows: half, quarter and tenth (`student=<size>`: 57%, 21% and 10% of the teacher's transformer), each started
from the pruned teacher (`student.init=teacher`) and from random weights (`student.init=random`), each trained
with output KD alone (`loss=distillation`) and with several-layer feature KD (`loss=features`). Every row
trains through `wandistiller.train` on the teacher's images (`data=pocket_digits`), at the one budget its size
is given (`BUDGETS`), and is judged on the same noises as the teacher's row: prompt accuracy, FID, latent MSE,
seconds per image and training time; `params` is the share of the teacher's parameters.

Runs are independent, so `--jobs N` trains N at once (one torch thread each): on 2 cores, 2 jobs take about
half the wall time of one, and each run's `train_s` is then its time beside the others.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from wandistiller.core.files import write_in_run
from wandistiller.evaluation.metrics import heldout_reference
from wandistiller.pocket.classifier import load_classifier
from wandistiller.quality.compare import Settings, sample, score, seed_mean, train_student

# Training steps of batch 16 per size: the budget at which each size is judged (docs/QUALITY.md). The smaller
# sizes take more steps for the same wall clock (a step of `tenth` costs about half of one of `half`).
BUDGETS = {"half": 1000, "quarter": 4000, "tenth": 4000}
INITS = {"pruned": "student.init=teacher", "random": "student.init=random"}
LOSSES = {"output KD": ["loss=distillation"], "several-layer KD": ["loss=features"]}
COLUMNS = ["params", "prompt_accuracy", "fid", "latent_mse", "s_per_image", "train_s"]


@dataclass(frozen=True)
class Row:
    size: str
    init: str
    loss: str

    @property
    def name(self) -> str:
        return f"{self.size}, {self.init}, {self.loss}"

    def overrides(self) -> list[str]:
        return [INITS[self.init], *LOSSES[self.loss], "data=pocket_digits"]  # student=<size>: Settings.student


def rows(sizes: tuple[str, ...] = tuple(BUDGETS)) -> list[Row]:
    return [Row(size, init, loss) for size in sizes for init in INITS for loss in LOSSES]


def _train_and_sample(settings: Settings, row: Row, seed: int, run_dir: Path, cache: Path) -> tuple[dict, dict]:
    """One row of one seed, in its own process: (the student's samples, the run's summary)."""

    torch.set_num_threads(1)
    summary = train_student(replace(settings, student=row.size), row.overrides(), seed, run_dir, cache)
    return sample(run_dir, "student", settings, seed), summary


def compare_compression(
    settings: Settings, work: Path, budgets: dict[str, int] = BUDGETS, jobs: int = 1, log=print
) -> dict[str, list[dict]]:
    """{"teacher" and each row's name: [scores per seed]}, `params` as the share of the teacher's parameters;
    each size trains `budgets[size]` steps (the sizes measured are the budgets' keys).

    The first run is trained alone, so the shared caches (text embeddings, the images' latents) are written once
    before several processes read them."""

    judge, reference, cache = load_classifier(), heldout_reference(), work / "cache"
    sizes = tuple(budgets)
    todo = [(seed, row) for seed in settings.seeds for row in rows(sizes)]
    results: dict[str, list[dict]] = {name: [] for name in ["teacher", *(row.name for row in rows(sizes))]}
    teachers: dict[int, dict] = {}

    def budget(row: Row) -> Settings:
        return replace(settings, max_steps=budgets[row.size])

    def finish(seed: int, row: Row, made: dict, summary: dict, run_dir: Path, started: float) -> None:
        if seed not in teachers:  # the teacher's samples once per seed, through the first run folder of it
            teachers[seed] = sample(run_dir, None, settings, seed)
            results["teacher"].append(score(teachers[seed], teachers[seed]["latents"], judge, reference))
        teacher = teachers[seed]
        scores = score(made, teacher["latents"], judge, reference)
        scores["params"] = made["params"] / teacher["params"]
        scores["train_s"] = summary.get("wall_s", time.perf_counter() - started)
        results[row.name].append(scores)
        log(f"seed {seed} {row.name}: " + "  ".join(f"{k} {v:.4g}" for k, v in scores.items()))

    def run_dir(seed: int, row: Row) -> Path:
        return work / f"seed{seed}" / "-".join(part.replace(" ", "_") for part in (row.size, row.init, row.loss))

    first, rest = todo[0], todo[1:]
    started = time.perf_counter()
    finish(
        *first,
        *_train_and_sample(budget(first[1]), first[1], first[0], run_dir(*first), cache),
        run_dir(*first),
        started,
    )
    if jobs <= 1:
        for seed, row in rest:
            started = time.perf_counter()
            made, summary = _train_and_sample(budget(row), row, seed, run_dir(seed, row), cache)
            finish(seed, row, made, summary, run_dir(seed, row), started)
        return _teacher_first(results)
    # spawn: a forked child would inherit this process's torch threads and locks.
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        started = time.perf_counter()
        futures = [
            (seed, row, pool.submit(_train_and_sample, budget(row), row, seed, run_dir(seed, row), cache))
            for seed, row in rest
        ]
        for seed, row, future in futures:
            made, summary = future.result()
            finish(seed, row, made, summary, run_dir(seed, row), started)
    return _teacher_first(results)


def _teacher_first(results: dict[str, list[dict]]) -> dict[str, list[dict]]:
    results["teacher"] = [r | {"params": 1.0} for r in results["teacher"]]
    return results


def targets(results: dict[str, list[dict]]) -> list[str]:
    """The compressed students' targets, each met or missed, from the means."""
    mark = lambda ok: "met" if ok else "MISSED"
    teacher_acc, teacher_fid = seed_mean(results["teacher"], "prompt_accuracy"), seed_mean(results["teacher"], "fid")
    acc = {name: seed_mean(runs, "prompt_accuracy") for name, runs in results.items()}
    fid = {name: seed_mean(runs, "fid") for name, runs in results.items()}
    best = lambda size, init: max((acc[r.name], r.name) for r in rows((size,)) if r.init == init)
    lines = []
    sizes = {r.size for r in rows() if r.name in results}
    if "quarter" in sizes:
        a, name = best("quarter", "pruned")
        ok = a >= 0.85 * teacher_acc and fid[name] <= 1.5 * teacher_fid
        lines.append(
            f"- quarter (best: {name}): {a / teacher_acc:.0%} of the teacher's accuracy (target >= 85%), "
            f"FID {fid[name] / teacher_fid:.2f}x the teacher's (target <= 1.5x): {mark(ok)}"
        )
    if "tenth" in sizes:
        a, name = best("tenth", "pruned")
        lines.append(
            f"- tenth (best: {name}): {a / teacher_acc:.0%} of the teacher's accuracy (target >= 60%): "
            f"{mark(a >= 0.6 * teacher_acc)}"
        )
    for size in ("quarter", "tenth"):
        if size not in sizes:
            continue
        for loss in LOSSES:
            pruned, random = acc[Row(size, "pruned", loss).name], acc[Row(size, "random", loss).name]
            lines.append(
                f"- {size}, {loss}: pruned start beats random by {(pruned - random) * 100:.1f} points "
                f"(target >= 30): {mark(pruned - random >= 0.30)}"
            )
        output, several = acc[Row(size, "pruned", "output KD").name], acc[Row(size, "pruned", "several-layer KD").name]
        lines.append(
            f"- {size}, pruned: several-layer KD {several:.1%} vs output KD {output:.1%}: "
            f"{'several-layer KD better' if several > output else 'output KD as good or better'}"
        )
    return lines


def plot(results: dict[str, list[dict]], path: Path) -> None:
    """compression.png: prompt accuracy against the share of the teacher's parameters, one line per start and
    loss, the teacher's accuracy as a line across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for init in INITS:
        for loss in LOSSES:
            points = sorted(
                (
                    seed_mean(runs, "params"),
                    seed_mean(runs, "prompt_accuracy") * 100,
                    statistics.pstdev([r["prompt_accuracy"] * 100 for r in runs]) if len(runs) > 1 else 0.0,
                )
                for name, runs in results.items()
                if name != "teacher" and name.split(", ")[1:] == [init, loss]
            )
            if points:
                x, y, err = zip(*points)
                ax.errorbar(
                    x,
                    y,
                    yerr=err,
                    marker="o",
                    capsize=3,
                    label=f"{init} start, {loss}",
                    linestyle="-" if init == "pruned" else "--",
                )
    ax.axhline(seed_mean(results["teacher"], "prompt_accuracy") * 100, color="black", linewidth=1, label="teacher")
    ax.set_xscale("log")
    shares = sorted({round(seed_mean(runs, "params"), 3) for name, runs in results.items() if name != "teacher"})
    ax.set_xticks(shares, [f"{s:.0%}" for s in shares])
    ax.minorticks_off()
    ax.set_xlabel("student parameters (share of the teacher's transformer)")
    ax.set_ylabel("prompt accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Compression on the pocket teacher (mean ± std over seeds)")
    ax.legend(fontsize=8, loc="lower center")
    fig.tight_layout()

    # whole, beside the report: a link in its place is replaced, never written through
    write_in_run(Path(path).parent, Path(path).name, write=lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
