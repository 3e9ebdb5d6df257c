"""SIGTERM and Ctrl-C: finish the step, save a checkpoint, exit with one line saying how to resume.

Slurm and Kubernetes send SIGTERM before they kill; a user presses Ctrl-C. The first signal only sets a
flag, which the loop reads once per step (`requested`); every training rank agrees on it, so they stop
at the same step and the checkpoint is a consistent one. A second signal exits at once, the way the
signal would have without us.

Before a training step has finished (setup: loading the teacher, compiling, the first step's compile; the
tools) there is no step end to wait for, and that phase can last minutes: a signal then stops at once with
one line, `stopped by SIG before a training step could finish; <what is kept>`. One class, `Stop`, does
both: at once until the loop's first `requested()`, then at the step boundary.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from wandistiller.core.errors import Stopped, exit_on_user_error, internal_errors_reported

# What signal.signal takes and returns: a function, SIG_DFL/SIG_IGN, or None (a handler not set from Python).
_Handler = Callable[[int, FrameType | None], Any] | int | None

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A launched worker gets a Ctrl-C twice at once: from the terminal (its process group) and forwarded by
# the elastic agent. Within this many seconds a second signal is the same request, not a second one.
ECHO_S = 1.0
# Set for the workers `distributed.launch` starts: their launcher prints the line (`launcher_stopped`).
LAUNCHED = "WANDISTILLER_LAUNCHED"


NOTHING_SAVED = "nothing to save, no checkpoint written; run the same command to start again"


def at_once_line(name: str, then: str) -> str:
    """The one line of a stop before any training step could finish."""
    return f"stopped by {name} before a training step could finish; {then}"


def _says_it() -> bool:
    """Whether this process says the line: once per job (rank 0), and not a launched worker (its launcher does)."""
    return os.environ.get(LAUNCHED) != "1" and os.environ.get("RANK", "0") == "0"


class Stop:
    """The stop requests of one process. `immediate`: a signal stops at once, with `then` saying what is kept,
    until the loop's first `requested()` (a step is done); after that, at the step boundary with a checkpoint
    (`requested()` once per step, `exit()` after the checkpoint). At once means `os._exit` from the handler
    (`hard`, in setup: the signal may land inside torch.compile's tracing, which wraps any exception into an
    internal error), or a `_Signalled` raised through the code (`stop_at_once`: the tools, the job's shell)."""

    def __init__(self, immediate: bool = False, then: str = NOTHING_SAVED, hard: bool = True):
        self.immediate, self.then, self.hard = immediate, then, hard
        self.signum: int | None = None
        self._first = 0.0
        self._previous: dict[int, _Handler] = {}

    def install(self) -> Stop:
        """Catch SIGTERM/SIGINT until `restore` (signals can only be caught in the main thread)."""
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def restore(self) -> None:
        while self._previous:
            s, handler = self._previous.popitem()
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.immediate:
            self._stop_now(name, signum)
        if self.signum is not None and time.monotonic() - self._first < ECHO_S:
            return  # the same request again: Ctrl-C reaches a worker from the terminal and from its launcher
        if self.signum is not None:  # the second one: what the signal does by default, now
            self.restore()
            signal.signal(signum, signal.SIG_DFL)
            os.write(2, f"\n{name} again: exiting now, without a checkpoint\n".encode())
            os.kill(os.getpid(), signum)
            return
        self.signum, self._first = signum, time.monotonic()
        # os.write, not print: a signal can arrive in the middle of a print to the same stream.
        os.write(2, f"\n{name}: stopping after this step with a checkpoint ({name} again exits at once)\n".encode())

    def _stop_now(self, name: str, signum: int) -> None:
        self.restore()
        if not self.hard:
            raise _Signalled(signum)
        if _says_it():
            os.write(2, f"\n{at_once_line(name, self.then)}\n".encode())
        os._exit(128 + signum)  # no checkpoint exists to be half-written; the OS frees the run folder's lock

    def requested(self, group=None) -> bool:
        """Whether to stop after this step. With `group` (the training ranks), true on every rank as soon
        as one of them was signalled: a small all-reduce, so that all stop at the same step."""
        self.immediate = False  # a step is done: from now on a signal stops at a step boundary
        flag = self.signum is not None
        if group is not None:
            t = torch.tensor([int(flag)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            flag = bool(t.item())
        return flag

    def exit(self, run_dir, step: int, is_main: bool = True) -> None:
        """Raise Stopped, whose one line (main rank only) says how to continue; call after the checkpoint."""
        self.restore()
        name = signal.Signals(self.signum).name if self.signum else "a signal on another rank"
        message = f"stopped by {name} after step {step}, with a checkpoint; to continue, {how_to_continue(run_dir)}"
        said_by_launcher = os.environ.get(LAUNCHED) == "1"
        raise Stopped(message if is_main and not said_by_launcher else "", 128 + (self.signum or signal.SIGTERM))


def how_to_continue(run_dir) -> str:
    """The command that continues a stopped run: a sweep's point is continued by its sweep (Hydra's -m ignores
    hydra.run.dir, so "the same command with hydra.run.dir=<point>" started a new sweep from step 0)."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        sweep = HydraConfig.get().sweep.dir
        return f"run the same sweep (-m) with trainer.resume=auto hydra.sweep.dir={sweep}"
    return f"run the same command with trainer.resume=auto hydra.run.dir={run_dir}"


def launcher_stopped(error, run_dir) -> Stopped:
    """What the process that launched the workers says when a signal stopped them: they saved a
    checkpoint and said nothing, so that the user reads one line, not one per process."""
    return Stopped(
        f"stopped by {signal.Signals(error.sigval).name}; the workers saved a checkpoint at their last step; to "
        f"continue, {how_to_continue(run_dir)}",
        128 + error.sigval,
    )


class _Signalled(BaseException):
    """Raised by `stop_at_once`'s handler; a BaseException, so no `except Exception` on its way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


Signalled = _Signalled  # what a stop in the end-of-run work raises (recipe/outputs.py keeps the student first)


def end_of_run_stopped(signum: int, skipped: list[str], run_dir) -> Stopped:
    """The one line of a stop during the end-of-run work (the evaluation, the last sample grid): training was done,
    and what it made is kept; what was skipped, and how to run it now."""
    name = signal.Signals(signum).name
    return Stopped(
        f"stopped by {name} in the end-of-run work, after training finished: the trained student is kept "
        f"({run_dir}: student/, pipeline/, metrics.json); skipped: {', '.join(skipped)} (python -m wandistiller.eval "
        f"{run_dir} evaluates it now)",
        128 + signum,
    )


@contextlib.contextmanager
def stop_at_once(then: str):
    """Outside the training steps (setup, the end-of-run evaluation, the eval/generate tools) there is no
    step end to wait for: SIGTERM or Ctrl-C stops at once, with one line saying what is kept (`then`)."""
    stop = Stop(immediate=True, then=then, hard=False).install()
    try:
        yield
    except _Signalled as e:
        stop.restore()
        line = at_once_line(signal.Signals(e.signum).name, then)
        said = os.environ.get("RANK", "0") == "0"  # under torchrun, rank 0 says it once
        raise Stopped(line if said else "", 128 + e.signum) from None
    finally:
        stop.restore()


def install() -> Stop:
    """A fresh Stop catching SIGTERM and SIGINT; the loop calls this once before its first step (a signal
    before that step is done exits at once) and setup around loading and compiling."""
    return Stop(immediate=True).install()


@contextlib.contextmanager
def tool_session(stop: str | None = None, unwind_on_term: bool = False) -> Iterator[None]:
    """What every tool's `main` (eval, generate, export, pipeline) runs inside: log lines as plain messages, a
    mistake one `error:` line (exit 2), a bug one line saying how to report it, and a signal either one line saying
    what is kept (`stop`: stop_at_once's) or, with `unwind_on_term`, SIGTERM unwinding like Ctrl-C so a tool's
    temporary folder is removed on the way out."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if unwind_on_term:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with internal_errors_reported(), exit_on_user_error():
        with stop_at_once(stop) if stop is not None else contextlib.nullcontext():
            yield
