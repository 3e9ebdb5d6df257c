"""SIGTERM and Ctrl-C: finish the step, save a checkpoint, exit with one line saying how to resume.

Slurm and Kubernetes send SIGTERM before they kill; a user presses Ctrl-C. The first signal only sets a
flag, which the loop reads once per step (`requested`); every training rank agrees on it, so they stop
at the same step and the checkpoint is a consistent one. A second signal exits at once, the way the
signal would have without us.

Before the first step has finished (loading the teacher, compiling, the first step's compile) there is
nothing to save, and that phase can last minutes: a signal then exits at once with one line, no
checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from wandistiller.core.errors import Stopped

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A launched worker gets a Ctrl-C twice at once: from the terminal (its process group) and forwarded by
# the elastic agent. Within this many seconds a second signal is the same request, not a second one.
ECHO_S = 1.0
# Set for the workers `distributed.launch` starts: their launcher prints the line (`launcher_stopped`).
LAUNCHED = "WANDISTILLER_LAUNCHED"


class Stop:
    """The loop's view of a stop request: `requested()` once per step, `exit()` after the checkpoint."""

    def __init__(self, immediate: bool = False):
        # Exit at the signal (nothing to save yet); the first `requested()` (a step is done) turns it off.
        self.immediate = immediate
        self.signum: int | None = None
        self._first = 0.0
        self._previous: dict[int, object] = {}

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
            self._exit_before_first_step(name, signum)
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

    def _exit_before_first_step(self, name: str, signum: int) -> None:
        """Exit now, from the handler. Not by raising: the signal may land inside torch.compile's tracing,
        which wraps any exception into an internal error, or in code that swallows it."""
        self.restore()
        message = (
            f"stopped by {name} before the first training step finished (loading or compiling): nothing to "
            "save, no checkpoint written; run the same command to start again"
        )
        if os.environ.get(LAUNCHED) != "1":  # (a launched worker's launcher says it)
            os.write(2, f"\n{message}\n".encode())
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
        message = (
            f"stopped by {name} after step {step}, with a checkpoint; to continue, run the same command with "
            f"trainer.resume=auto hydra.run.dir={run_dir}"
        )
        said_by_launcher = os.environ.get(LAUNCHED) == "1"
        raise Stopped(message if is_main and not said_by_launcher else "", 128 + (self.signum or signal.SIGTERM))


def launcher_stopped(error, run_dir) -> Stopped:
    """What the process that launched the workers says when a signal stopped them: they saved a
    checkpoint and said nothing, so that the user reads one line, not one per process."""
    return Stopped(
        f"stopped by {signal.Signals(error.sigval).name}; the workers saved a checkpoint at their last step; to "
        f"continue, run the same command with trainer.resume=auto hydra.run.dir={run_dir}",
        128 + error.sigval,
    )


class _Signalled(BaseException):
    """Raised by `stop_at_once`'s handler; a BaseException, so no `except Exception` on its way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def stop_at_once(then: str):
    """Outside the training steps (setup, the end-of-run evaluation, the eval/generate tools) there is no
    step end to wait for: SIGTERM or Ctrl-C stops at once, with one line saying what is kept (`then`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum, frame):
        raise _Signalled(signum)

    previous = {s: signal.signal(s, handle) for s in SIGNALS}
    try:
        yield
    except _Signalled as e:
        for s, handler in previous.items():
            signal.signal(s, handler)
        said = os.environ.get("RANK", "0") == "0"  # under torchrun, rank 0 says it once
        message = f"stopped by {signal.Signals(e.signum).name} before a training step could finish; {then}"
        raise Stopped(message if said else "", 128 + e.signum) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def install() -> Stop:
    """A fresh Stop catching SIGTERM and SIGINT; the loop calls this once before its first step (a signal
    before that step is done exits at once) and setup around loading and compiling."""
    return Stop(immediate=True).install()
