"""`hooks.monitor`: what a run shows while it trains, on the main rank, after every step: the per-step metrics
appended to `metrics_steps.jsonl` as they happen, and the held-out `val/loss` (overall and per noise band)
every `hooks.monitor.val_every` steps with `checkpoints/best/` and `loss.png`.

`val/loss` is the student's velocity error against the teacher's at held-out timesteps: what a KD student is
trained on. A few-step student (`method.steps` = K: trajectory, dmd) is trained to sample in K steps, which that
error does not measure (dmd's students sharpen away from the teacher's velocity as they improve), so its run
logs `val/loss` as a diagnostic and keeps no `checkpoints/best/`: `eval --checkpoint step_N` compares its
checkpoints by what they sample."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from wandistiller.core.errors import UserError
from wandistiller.core.files import open_in, read_json_in
from wandistiller.core.registry import Option
from wandistiller.data.validation import ValSet, save_loss_plot, val_loss
from wandistiller.recipe.hooks.base import Hook, at_least
from wandistiller.recipe.loop import training_state
from wandistiller.state.checkpoint import CHECKPOINTS, STATE_FILE, write_checkpoint

log = logging.getLogger("wandistiller")


@dataclass
class MonitorConfig:
    _target_: str = "wandistiller.recipe.hooks.monitor.Monitor"
    # Held-out val/loss (and checkpoints/best/, loss.png) every N steps; 0 = never (no held-out set is made).
    val_every: int = 50


class Monitor(Hook):
    """Validation and the per-step metrics file, after each step's optimizer update and checkpoint."""

    validates = True  # the recipe makes the held-out set for the hook that asks (recipe/hooks/__init__.py)

    def __init__(self, val_every: int = MonitorConfig.val_every):
        self.val_every = at_least("hooks.monitor.val_every", val_every, 0)
        self.val_set: ValSet | None = None
        self.written = 0  # run.history entries already in metrics_steps.jsonl
        self.best: float | None = None  # checkpoints/best's held-out loss, read on the first validation
        self.keeps_best = True  # not for a few-step student (the module's docstring)

    def bind(self, ctx, parts) -> None:
        self.val_set = parts.val_set
        self.keeps_best = ctx.student_steps is None
        if self.val_set is not None and not self.keeps_best and ctx.is_main:
            log.info(
                "val/loss is the velocity error of a KD student; a %d-step student is judged by what it samples: no "
                "checkpoints/best/ (compare checkpoints with eval --checkpoint step_N)",
                ctx.student_steps,
            )
        last = ctx.trainer_cfg.max_steps
        if self.val_every > last:
            log.warning(
                "hooks.monitor.val_every=%d > trainer.max_steps=%d: no validation will run", self.val_every, last
            )

    def __call__(self, run, step: int) -> None:
        row: dict = {}
        if self.val_set is not None and self.val_every > 0 and step % self.val_every == 0:
            row = self.validate(run, step)
        self.append_metrics(run, row)
        if row:
            save_loss_plot(run.run_dir)

    def validate(self, run, step: int) -> dict:

        assert self.val_set is not None  # called only with a held-out set
        metrics = val_loss(
            run.student, None, self.val_set, device=run.device, autocast_dtype=run.precision.autocast_dtype
        )
        run.tracker.log(metrics, step=step)
        log.info("step %d: %s", step, ", ".join(f"{k} {v:.5f}" for k, v in metrics.items()))
        if not self.keeps_best:
            return {"step": step} | metrics
        if self.best is None:  # a resumed run's best so far: a worse checkpoint never replaces it
            self.best = saved_best(Path(run.run_dir))
        if metrics["val/loss"] < self.best:
            self.best = metrics["val/loss"]
            write_checkpoint(Path(run.run_dir) / CHECKPOINTS / "best", step, training_state(run) | {"val": metrics})
        return {"step": step} | metrics

    def append_metrics(self, run, extra: dict) -> None:
        """Rows not yet written (an interrupted run keeps what it measured), then `extra` (a validation)."""
        rows = run.history[self.written :] + ([extra] if extra else [])
        self.written = len(run.history)
        append_rows(Path(run.run_dir), rows)


def append_rows(run_dir: Path, rows: list[dict]) -> None:
    """`rows` appended to the run's `metrics_steps.jsonl`, one JSON line each (other hooks' figures too:
    hooks.collapse), past a torn last line."""
    if rows:
        text = "".join(json.dumps(r) + "\n" for r in rows)
        with open_in(run_dir, "metrics_steps.jsonl", "a+b") as f:  # appends land at the end; guarded
            end = f.seek(0, os.SEEK_END)
            if end and f.seek(end - 1) is not None and f.read(1) != b"\n":  # a killed write's torn line
                text = "\n" + text  # ends it, so the rows that follow stay whole
            f.write(text.encode())


def saved_best(run_dir: Path) -> float:
    """The held-out loss checkpoints/best was saved with (inf when there is none, or it cannot be read)."""

    try:
        value = read_json_in(run_dir, f"{CHECKPOINTS}/best/{STATE_FILE}")["val"]["val/loss"]
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return math.inf
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else math.inf


OPTION = Option("monitor", MonitorConfig, Monitor)
