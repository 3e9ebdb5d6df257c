"""`method=dummy`: the kd step with its loss scaled by `method.weight`, and a network of its own beside the student: a
`shadow`, a copy of the student that learns to give the student's prediction, one update per step. It declares the
shadow in `passes` and nowhere else, and `python -m wandistiller.plan` counts it (tests/core/test_plugins.py)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option
from wandistiller.placements.memory import STUDENT_SHAPED, OwnNetwork
from wandistiller.placements.steptime import Passes
from wandistiller.recipe.loop import Clock, Run, distill_step
from wandistiller.recipe.methods.base import Method, Network


@dataclass
class DummyConfig:
    _target_: str = "dummyplugin.method.dummy.Dummy"
    name: str = "dummy"
    steps: int | None = None
    weight: float = 1.0


class Dummy(Method):
    name = "dummy"
    card_phrase = "the student transformer learned the teacher's velocity, scaled (guidance scale {g})"

    def __init__(self, *, name: str, steps: int | None, weight: float):
        if weight <= 0:
            raise UserError(f"method.weight={weight} must be positive; e.g. method.weight=0.5")
        super().__init__(name, steps)
        self.weight = weight

    def passes(self, micro_batches: int, whole_step: bool) -> Passes:
        """kd's passes, a student forward without grad (the shadow's target), and the shadow's update."""
        kd = super().passes(micro_batches, whole_step)
        shadow = OwnNetwork("shadow", "method=dummy", STUDENT_SHAPED, trains=1)
        return replace(kd, student_forwards=kd.student_forwards + 1, networks=(shadow,))

    def bind(self, ctx, student, trainer_cfg, state, group) -> None:
        shadow = copy.deepcopy(student).train()
        optimizer = torch.optim.AdamW(shadow.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(ctx.device.type, enabled=False)
        self.networks = {"shadow": Network(shadow, optimizer, scaler)}
        if state is not None:
            self.load_state_dict(state.get("method"))

    def other_updates(self, run: Run, step: int) -> dict[str, torch.Tensor]:
        shadow = self.networks["shadow"]
        batch = run.batch_fn(step, 0, run.dp_rank).to(run.device)
        with torch.no_grad():
            target, _ = run.model(batch.x_t, batch.t, batch.cond, batch.image)
        pred, _ = shadow.module(batch.x_t, batch.t, batch.cond, batch.image)
        loss = F.mse_loss(pred.float(), target.float())
        loss.backward()
        shadow.optimizer.step()
        shadow.optimizer.zero_grad(set_to_none=True)
        return {"loss_shadow": loss.detach()}

    def student_loss(
        self, run: Run, step: int, micro: int, clock: Clock
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], tuple[object, object] | None]:
        batch = run.batch_fn(step, micro, run.dp_rank).to(run.device)
        loss, parts, span = distill_step(run, step, micro, batch, clock)
        return loss * self.weight, parts | {"dummy_weight": torch.tensor(self.weight)}, span


OPTION = Option("dummy", DummyConfig, Dummy)
