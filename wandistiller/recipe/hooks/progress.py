"""`hooks.progress`: a line in train.log every `trainer.log_every` steps."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from wandistiller.core.errors import rate, write_to_log_files
from wandistiller.core.registry import Option
from wandistiller.recipe.hooks.base import Hook

log = logging.getLogger("wandistiller")


@dataclass
class ProgressConfig:
    _target_: str = "wandistiller.recipe.hooks.progress.ProgressLog"


class ProgressLog(Hook):
    """A loop hook: a line in train.log every `trainer.log_every` steps (step, loss, samples/s), so the log
    shows a run's progress while it runs. With the progress bar on, the terminal already shows it: the
    line then goes to the log file alone, not between the bar's redraws."""

    def __init__(self):
        self.t: Any = None  # the run's trainer node, from bind

    def bind(self, ctx, parts) -> None:
        self.t = ctx.trainer_cfg

    def __call__(self, run, step: int) -> None:
        if step % self.t.log_every and step != self.t.max_steps:
            return
        last = run.history[-1] if run.history else {}
        line = (
            f"step {step}/{self.t.max_steps}: loss {last.get('loss', float('nan')):.5f}, "
            f"{rate(last.get('samples_per_s'))} samples/s, lr {last.get('lr', 0.0):.3g}"
        )
        if self.t.progress_bar:
            write_to_log_files(line)
        else:
            log.info(line)


OPTION = Option("progress", ProgressConfig, ProgressLog)
