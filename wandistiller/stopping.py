"""SIGTERM and Ctrl-C: finish the step, save a checkpoint, exit with one line saying how to resume.

Slurm and Kubernetes send SIGTERM before they kill; a user presses Ctrl-C. The first signal only sets a
flag, which the loop reads once per step (`requested`); every training rank agrees on it, so they stop
at the same step and the checkpoint is a consistent one. A second signal exits at once, the way the
signal would have without us.
"""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

from wandistiller.errors import Stopped

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stop:
    """The loop's view of a stop request: `requested()` once per step, `exit()` after the checkpoint."""

    def __init__(self):
        self.signum: int | None = None
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
        if self.signum is not None:  # the second one: what the signal does by default, now
            self.restore()
            signal.signal(signum, signal.SIG_DFL)
            os.write(2, f"\n{name} again: exiting now, without a checkpoint\n".encode())
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        # os.write, not print: a signal can arrive in the middle of a print to the same stream.
        os.write(2, f"\n{name}: stopping after this step with a checkpoint ({name} again exits at once)\n".encode())

    def requested(self, group=None) -> bool:
        """Whether to stop after this step. With `group` (the training ranks), true on every rank as soon
        as one of them was signalled: a small all-reduce, so that all stop at the same step."""
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
        raise Stopped(message if is_main else "", 128 + (self.signum or signal.SIGTERM))


def install() -> Stop:
    """A fresh Stop catching SIGTERM and SIGINT; the loop calls this once before its first step."""
    return Stop().install()
