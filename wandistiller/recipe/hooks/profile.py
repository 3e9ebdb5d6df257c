"""`hooks.profile`: where a training step's time goes. It profiles `steps` steps after the first `after` (the first
steps compile and allocate) with torch.profiler and writes, on the main rank:

    <run>/profile/trace.json   the steps' timeline (open it in Perfetto or chrome://tracing)
    <run>/profile/ops.txt      the ops by self time, host and device, `rows` of them

and one line in train.log: the milliseconds a step (the profiler's own cost included), and on a GPU the share of it
the device spent in kernels and the kernel launches a step. A step whose kernels fill a small share is paced by the
host (Python, hooks, launches), not by the GPU: what `teacher.compile` addresses. Other hooks that fire inside the
window are in it too.
Add it to the list: `hooks=[monitor,progress,samples,evaluate,collapse,profile] hooks.profile.after=5`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from wandistiller.core.errors import UserError
from wandistiller.core.files import replace_folder, write_in_run
from wandistiller.core.registry import Option
from wandistiller.recipe.hooks.base import Hook, at_least

log = logging.getLogger("wandistiller")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")


@dataclass
class ProfileConfig:
    _target_: str = "wandistiller.recipe.hooks.profile.StepProfile"
    after: int = 2
    steps: int = 3
    rows: int = 40


class StepProfile(Hook):
    """A loop hook: torch.profiler over steps `after + 1` to `after + steps` (module docstring)."""

    def __init__(self, after: int, steps: int, rows: int):
        self.after = at_least("hooks.profile.after", after, 1)
        self.steps = at_least("hooks.profile.steps", steps, 1)
        self.rows = at_least("hooks.profile.rows", rows, 1)
        self.run_dir, self.device = Path(), torch.device("cpu")
        self.profiler: Any = None
        self.first = self.last = 0
        self.started = 0.0
        self.figures: dict[str, float] = {}

    def check(self, cfg) -> None:
        max_steps = int(cfg.trainer.max_steps)
        if self.after >= max_steps:
            raise UserError(
                f"hooks.profile.after={self.after} leaves no step to profile in trainer.max_steps={max_steps}; give "
                + (f"hooks.profile.after={max_steps - 1} or less" if max_steps > 1 else "trainer.max_steps=3 or more")
            )

    def bind(self, ctx, parts) -> None:
        self.run_dir = Path(ctx.run_dir)
        self.device = ctx.device

    def __call__(self, run, step: int) -> None:
        self.last = step
        if self.profiler is None and not self.figures and step >= self.after:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()
            self._sync()
            self.first, self.started = step, time.perf_counter()
        elif self.profiler is not None and step - self.first >= self.steps:
            self._finish(step)

    def at_end(self, run) -> dict[str, Any]:
        if self.profiler is not None:  # the run ended inside the window: what it profiled
            self._finish(self.last)
        return {f"profile_{k}": v for k, v in self.figures.items()}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _finish(self, step: int) -> None:
        self._sync()
        seconds, steps = time.perf_counter() - self.started, max(step - self.first, 1)
        self.profiler.__exit__(None, None, None)
        profiler, self.profiler = self.profiler, None
        ops = profiler.key_averages()
        sort = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"

        def write(folder: Path) -> None:
            profiler.export_chrome_trace(str(folder / "trace.json"))
            write_in_run(folder, "ops.txt", ops.table(sort_by=sort, row_limit=self.rows) + "\n")

        folder = replace_folder(self.run_dir, "profile", write)  # a run resumed and profiled again: the new window
        self.figures = {"ms_per_step": 1000 * seconds / steps, "steps": float(steps)}
        line = f"profile: steps {self.first + 1}-{step}: {self.figures['ms_per_step']:.0f} ms a step (profiled)"
        if self.device.type == "cuda":
            # The kernels' own rows (a CPU op's device time repeats its kernels'), in microseconds.
            busy = sum(e.self_device_time_total for e in ops if e.device_type != DeviceType.CPU) / 1e6 / seconds
            launches = sum(e.count for e in ops if e.key in LAUNCHES) / steps
            self.figures |= {"device_busy": busy, "launches_per_step": launches}
            line += f", the GPU in kernels {busy:.0%} of it, {launches:.0f} kernel launches a step"
        log.info(f"{line}; {folder / 'trace.json'} (Perfetto), {folder / 'ops.txt'}")


OPTION = Option("profile", ProfileConfig, StepProfile)
