"""When a worker fails: each rank leaves its own error with a time, the launching job names the rank that
really failed (not a survivor whose connection to it broke), and a CUDA out-of-memory becomes one report."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from wandistiller.core.errors import UserError
from wandistiller.core.files import read_json_in, run_folder, write_in_run

FAILURES = ".failures"

# What the survivors of a crashed rank report: symptoms, not the cause.
COLLATERAL = (
    "Connection closed by peer",
    "Connection reset",
    "remote worker",
    "Broken pipe",
    "ProcessGroup",
    "NCCL communicator was aborted",
)


def record_failure(run_dir: Path, rank: int, error: BaseException) -> None:
    """This rank's error, first line only, with the time it happened (read by `root_cause`)."""

    run_folder(run_dir, FAILURES)  # never through a received folder's link out of it
    cause = error.__context__ if isinstance(error, SystemExit) and error.__context__ else error
    first_line = str(cause).splitlines()[0] if str(cause) else ""
    message = first_line if isinstance(cause, UserError) else f"{type(cause).__name__}: {first_line}"
    record = {"rank": rank, "time": time.time(), "message": message}
    write_in_run(run_dir, f"{FAILURES}/rank{rank}.json", json.dumps(record))


def root_cause(error, run_dir: Path) -> tuple[int, str]:
    """The failed rank whose error is not just a broken connection to another failed rank; earliest first."""

    failures_dir = run_dir / FAILURES
    found = [read_json_in(run_dir, f) for f in sorted(failures_dir.glob("rank*.json"))]  # never through a link out
    shutil.rmtree(failures_dir, ignore_errors=True)
    for rank, failure in error.failures.items():  # what the launcher saw (error files written by @record)
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
        found.append(
            {
                "rank": rank,
                "time": failure.timestamp,
                "message": message.splitlines()[0] if message else f"exit code {failure.exitcode}",
            }
        )
    found.sort(key=lambda f: (any(s in f["message"] for s in COLLATERAL), f["time"]))
    return found[0]["rank"], found[0]["message"]


def oom_report(error: Exception, plan_table: str | None) -> str:
    """One report for a CUDA out-of-memory: per-device memory now, and the planner's view."""
    lines = [f"CUDA out of memory on rank {os.environ.get('RANK', 0)}: {str(error).splitlines()[0]}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            lines.append(
                f"  GPU {i}: {torch.cuda.max_memory_allocated(i) / 2**30:.1f} GiB peak allocated here, "
                f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free"
            )
    if plan_table:
        lines += ["planner's estimates for this teacher and hardware:", plan_table]
    lines.append(
        "try: a placement the planner marks as fitting (teacher_placement=auto), a smaller "
        "trainer.batch_size, or trainer.gradient_checkpointing=true"
    )
    return "\n".join(lines)
