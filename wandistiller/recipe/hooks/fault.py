"""The failure-handling tests' injected failure, out of the loop: WANDISTILLER_INJECT_FAILURE=RANK:STEP[:oom]
makes that rank fail as it starts step STEP (after STEP steps finished), with a RuntimeError or an
out-of-memory error. Never configured: `hooks.build` adds it only where the variable is set."""

from __future__ import annotations

import os

import torch

from wandistiller.recipe.hooks.base import Hook


class FaultInjection(Hook):
    ENV = "WANDISTILLER_INJECT_FAILURE"
    main_only = False

    def __init__(self):
        rank, step, *kind = os.environ[self.ENV].split(":")
        mine = int(rank) == int(os.environ.get("RANK", 0))
        self.step, self.oom = (int(step) if mine else None), kind == ["oom"]

    def __call__(self, run, step: int) -> None:
        if step != self.step:
            return
        if self.oom:
            raise torch.OutOfMemoryError(f"injected out-of-memory at step {step}")
        raise RuntimeError(f"injected failure at step {step}")
