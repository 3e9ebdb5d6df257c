"""Sweep reports: one table and one plot comparing placements (and precisions, batch sizes, world sizes).

A Hydra callback writes `sweep_report.md` and `sweep_report.png` into the sweep folder when a multirun
ends, prints the table and gives it to every logger of the sweep (a wandb Table, tensorboard text, a csv). A
point with no metrics.json (its job was killed) is read from its metrics.csv where `logger=csv` left one.
`python scripts/compare_sweeps.py SWEEP [SWEEP]` rebuilds the report from any sweep folder, or puts two side
by side.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from wandistiller.core.atomic import atomic_write
from wandistiller.core.errors import RunDirTaken, UserError, WorkerFailed, exit_on_user_error
from wandistiller.core.files import read_json_in, write_in_run
from wandistiller.tracking import loggers
from wandistiller.tracking.loggers.csv import read_csv

log = logging.getLogger(__name__)

COLUMNS = [
    "point",
    "status",
    "placement",
    "precision",
    "world",
    "samples/s",
    "step ms (median ± sd)",
    "teacher ms",
    "student ms",
    "copy ms",
    "peak GPU GiB",
    "host RSS GiB",
    "val/loss",
    "note",
]


@dataclass
class Point:
    """One sweep point: its overrides and its metrics.json (or why it has none)."""

    folder: Path
    label: str
    metrics: dict

    @property
    def ok(self) -> bool:
        return self.metrics.get("status") == "completed"

    @property
    def peak_gpu_gib(self) -> float | None:
        peaks = [v for k, v in self.metrics.items() if k.startswith("gpu") and k.endswith("_peak_gib_max")]
        return max(peaks) if peaks else None


def load_points(sweep_dir: Path) -> list[Point]:
    """Every job folder of a sweep (the numbered subfolders Hydra made, in job order; or, under another
    hydra.sweep.subdir such as ${hydra.job.override_dirname}, each subfolder holding a job's .hydra/, by name),
    labelled by the overrides that differ between points (the ones the sweep varies)."""
    folders = sorted(
        (p for p in sweep_dir.iterdir() if p.is_dir() and (p.name.isdigit() or (p / ".hydra").is_dir())),
        key=lambda p: (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name),
    )
    overrides = []
    for folder in folders:
        file = folder / ".hydra" / "overrides.yaml"
        lines = [str(o) for o in OmegaConf.load(file)] if file.is_file() else []
        overrides.append({k: v for k, _, v in (o.partition("=") for o in lines if "=" in o)})
    keys = sorted({k for o in overrides for k in o})
    varying = [k for k in keys if len({o.get(k) for o in overrides}) > 1] or keys
    points = []
    for folder, o in zip(folders, overrides):
        metrics_file = folder / "metrics.json"
        metrics = read_json_in(folder, "metrics.json") if metrics_file.is_file() else from_csv(folder)
        label = " ".join(f"{k}={o[k]}" for k in varying if k in o) or folder.name
        points.append(Point(folder, label, metrics))
    return points


def from_csv(folder: Path) -> dict:
    """A point whose job died before its metrics.json: failed, with what its csv logger wrote (the last step,
    the last held-out loss) where it left a metrics.csv."""

    failed = {"status": "failed", "reason": "no metrics.json (the job died before it could write one)"}
    rows = read_csv(folder / "metrics.csv")[1]
    steps = [r["step"] for r in rows if str(r.get("step") or "").isdigit()]
    if not steps:
        return failed
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    reason = f"no metrics.json (the job died after step {steps[-1]}; read from metrics.csv)"
    return failed | {"reason": reason, "final_step": int(steps[-1])} | ({"val_loss_last": val[-1]} if val else {})


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table_rows(points: list[Point]) -> list[list[str]]:
    rows = []
    for p in points:
        m = p.metrics
        step = (
            "-" if m.get("step_ms_median") is None else f"{m['step_ms_median']:.1f} ± {m.get('step_ms_stdev', 0):.1f}"
        )
        note = (
            m.get("reason", "")
            if not p.ok
            else (f"owner idle {m['owner_idle_fraction']:.0%}" if m.get("owner_idle_fraction") is not None else "")
        )
        rows.append(
            [
                p.label,
                m.get("status", "?"),
                str(m.get("placement", "-")),
                str(m.get("precision", "-")),
                str(m.get("world_size", "-")),
                _num(m.get("samples_per_s_median"), ".1f"),
                step,
                _num(m.get("teacher_ms_median"), ".1f"),
                _num(m.get("student_ms_median"), ".1f"),
                _num(m.get("copy_ms_median"), ".1f"),
                _num(p.peak_gpu_gib, ".2f"),
                _num(m.get("host_peak_rss_gib_max"), ".2f"),
                _num(m.get("val_loss_last"), ".5f"),
                note,
            ]
        )
    return rows


def markdown_table(points: list[Point]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in table_rows(points)]
    return "\n".join(lines)


def plot(points: list[Point], path: Path, title: str) -> Path:
    """Throughput and peak memory per point, side by side; failed points marked, not dropped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One override per line, long ones wrapped, turned so neighbours never overlap.
    labels = ["\n".join(textwrap.fill(part, 22) for part in p.label.split(" ")) for p in points]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.4 * len(points) + 4), 5.6))
    throughput = [p.metrics.get("samples_per_s_median") or 0 if p.ok else 0 for p in points]
    memory = [(p.peak_gpu_gib or p.metrics.get("host_peak_rss_gib_max") or 0) if p.ok else 0 for p in points]
    memory_kind = "peak GPU GiB" if any(p.peak_gpu_gib for p in points) else "peak host RSS GiB"
    colors = ["tab:blue" if p.ok else "tab:red" for p in points]
    for ax, values, name in ((ax1, throughput, "samples/s"), (ax2, memory, memory_kind)):
        bars = ax.bar(range(len(points)), values, color=colors)
        ax.set_xticks(range(len(points)), labels, fontsize=7, rotation=30, ha="right")
        ax.set_ylabel(name)
        ax.set_title(name)
        for bar, p, v in zip(bars, points, values):
            ax.annotate(
                f"{v:.3g}" if p.ok else p.metrics.get("status", "failed"),
                (bar.get_x() + bar.get_width() / 2, v),
                ha="center",
                va="bottom",
                fontsize=8,
                color="black" if p.ok else "tab:red",
            )
    fig.suptitle(title)
    fig.tight_layout()
    write_in_run(Path(path).parent, Path(path).name, write=lambda f: fig.savefig(f, format="png", dpi=110))  # whole
    plt.close(fig)
    return path


def write_report(sweep_dir: Path) -> tuple[Path, Path, str]:
    points = load_points(sweep_dir)
    table = markdown_table(points)
    md = atomic_write(
        sweep_dir / "sweep_report.md", f"# Sweep {sweep_dir}\n\n{table}\n\n![throughput and memory](sweep_report.png)\n"
    )
    png = plot(points, sweep_dir / "sweep_report.png", str(sweep_dir))
    return md, png, table


def compare(a: Path, b: Path) -> str:
    """Two sweeps side by side, matched by point label: samples/s and peak memory, before -> after."""
    before = {p.label: p for p in load_points(a)}
    rows = ["| point | samples/s before | after | ratio | peak GiB before | after |", "|---|---|---|---|---|---|"]
    for p in load_points(b):
        q = before.get(p.label)
        s0 = q.metrics.get("samples_per_s_median") if q and q.ok else None
        s1 = p.metrics.get("samples_per_s_median") if p.ok else None
        ratio = f"{s1 / s0:.2f}x" if s0 and s1 else "-"
        m0 = (q.peak_gpu_gib or q.metrics.get("host_peak_rss_gib_max")) if q and q.ok else None
        m1 = (p.peak_gpu_gib or p.metrics.get("host_peak_rss_gib_max")) if p.ok else None
        rows.append(
            f"| {p.label} | {_num(s0, '.1f')} | {_num(s1, '.1f')} | {ratio} | {_num(m0, '.2f')} | {_num(m1, '.2f')} |"
        )
    return "\n".join(rows)


class LauncherCheck(Callback):
    """Hydra callback: a sweep sent to Slurm (hydra/launcher=slurm) from a machine that cannot submit is
    one line before anything is created, not submitit's traceback after an empty sweep folder."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:

        target = str(config.hydra.launcher.get("_target_", ""))
        if "SlurmLauncher" in target and shutil.which("sbatch") is None:
            with exit_on_user_error():
                raise UserError(
                    "hydra/launcher=slurm submits each sweep point with sbatch, and this machine has none (not a "
                    "Slurm login node); run the same command on the cluster, or drop hydra/launcher=slurm to sweep here"
                )


FAILED_SWEEP: list[str] = []  # sweeps of this process that failed (a crashed point, or none trained): exit code 1


class SweepReport(Callback):
    """Hydra callback: the report when a multirun ends (single runs are left alone); `loggers=false` keeps it
    out of the sweep's loggers (`wandb=`: the same flag's pre-release name)."""

    def __init__(self, loggers: bool = True, wandb: bool | None = None):
        self.loggers = loggers if wandb is None else wandb

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        md, png, table = write_report(sweep_dir)
        print(f"\nsweep report: {md}\n{table}\n", flush=True)
        points = load_points(sweep_dir)
        if self.loggers:  # the report through every logger of the sweep: a wandb Table, tensorboard text, a csv
            rows = table_rows(points)
            loggers.build(config.logger).report(sweep_dir, COLUMNS, rows, png, sweep_group(sweep_dir))
        # The exit code a script reads: a point that crashed, or none that trained, is a failed sweep; a point refused
        # beside ones that trained (gpu0 on a one-GPU machine) is one of its findings.
        # Said here; the exit code is the CLI's once Hydra has run every callback of the sweep (train.cli).
        failed = [p.label for p in points if p.metrics.get("status") == "failed"]
        if failed or not any(p.ok for p in points):
            what = (
                f"{len(failed)} point(s) failed: {', '.join(failed)}" if failed else "no point trained (each refused)"
            )
            print(f"error: {what}; the report above says why (exit code 1)", file=sys.stderr, flush=True)
            FAILED_SWEEP.append(str(sweep_dir))


def sweep_group(sweep_dir: Path) -> str:
    return "sweep-" + "-".join(sweep_dir.resolve().parts[-2:])


def sweep_point() -> dict | None:
    """This job's place in a Hydra multirun: its wandb group (the sweep) and name (its overrides)."""

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    hc = HydraConfig.get()
    return {
        "group": sweep_group(Path(hc.sweep.dir)),
        "name": hc.job.override_dirname or f"job{hc.job.num}",
        "overrides": list(hc.overrides.task),
        "choices": dict(hc.runtime.choices),
    }


def record_failed_point(cfg: DictConfig, error: UserError, point: dict) -> dict:
    """A failed or refused sweep point leaves a metrics.json saying so -- unless its folder holds
    another run's outputs, which are never touched."""
    print(f"error: {error}", file=sys.stderr, flush=True)
    run_dir = Path(cfg.paths.output_dir)
    record = {
        "status": "failed" if isinstance(error, WorkerFailed) else "refused",
        "reason": str(error).splitlines()[0],
        "placement": point["choices"].get("teacher_placement"),
        "precision": cfg.precision.name,
        "world_size": cfg.distributed.nproc_per_node * cfg.distributed.nnodes,
        "overrides": point["overrides"],
    }
    if isinstance(error, RunDirTaken) or (run_dir / "metrics.json").exists():
        return record
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ".hydra").mkdir(exist_ok=True)
    OmegaConf.save(OmegaConf.create(point["overrides"]), run_dir / ".hydra" / "overrides.yaml")
    atomic_write(run_dir / "metrics.json", json.dumps(record, indent=2))
    return record
