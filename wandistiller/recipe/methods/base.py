"""The interface every training method implements (`method=`): what one training step does, so the loop
(wandistiller/recipe/loop.py) stays one flat `for step` that knows no method.

A method is one module of this package defining `OPTION = Option("<name>", <its schema>, <its class>)`; its schema's
keys (`method.steps`, ...) are its constructor's, checked as it is built (preflight builds it once, before the run
folder). It declares

    name               its `method=` value (saved in the run's config as `method.name`)
    identity_keys      its `method.<key>`s that change what it trains or the networks it trains (K, dmd's fake
                       score): with `name`, its `identity()`, recorded in each checkpoint; a resume under another
                       identity is refused before the run folder is claimed (state/checkpoint.py's `check_method`)
    steps              K of a few-step student (`method.steps`; None: the student samples as the teacher does)
    teacher_in_loop    whether training calls the teacher (a dedicated teacher owner serves targets only then)
    student_inputs     whether it calls the teacher at inputs the student makes (a served teacher then receives
                       them from the ranks, x_t, t and prompt indices, instead of rebuilding them from the seed:
                       recipe/targets.py); trainer.teacher_whole_step, which rebuilds them, is refused with one
    uses_loss          whether it trains with trainer.loss (kd); one that does not refuses a loss set for it
    reads_x0           whether it reads the data's clean latents (kd); one that does not refuses a source that
                       samples the teacher for them (data=teacher_latents), which would be sampled for nothing
    passes(micro_batches, whole_step)  what one step runs, in passes of each network, and the networks it trains
                       beside the student (`Passes.networks`: shape, rank, optimizer states, passes): what the planner
                       counts of it, with no method named anywhere in placements/
    check_teacher(config)   refuse, in one line, a teacher its own networks cannot take (a LoRA wider than a layer)
    check(placement, ranks, device, teacher_cfg)   refuse, in one line, a placement (or teacher settings:
                       teacher.quantize, teacher.compile) it cannot train with
    prepare(ctx, teacher, embeddings)  before the student: what it samples from the teacher once (every rank calls it)
    bind(ctx, student, trainer_cfg, state, group)   after the student: the networks it trains beside it, restored
    networks           those networks (name -> Network: module, optimizer, updates per step), checkpointed with the run
    other_updates(run, step) -> parts  their updates of one step, before the student's (dmd's fake score)
    student_loss(run, step, micro, clock) -> (loss, parts, teacher span)   one micro-batch of the student

Parts are named scalars; the loop logs each as `loss_<name>` and the student trains on `loss` (their sum when
no part is called `loss`: wandistiller.recipe.losses.total).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from wandistiller.core.errors import UserError
from wandistiller.placements.steptime import Passes

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from wandistiller.data.conditions import ImageBank
    from wandistiller.data.prompts import PromptEmbeddings
    from wandistiller.placements.base import Placement
    from wandistiller.recipe.context import RunContext
    from wandistiller.recipe.loop import Clock, Run
    from wandistiller.teacher.model import Teacher


@dataclass
class Network:
    """A network a method trains beside the student, with its own optimizer and grad scaler, updated `updates`
    times per training step."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    updates: int = 1

    def state_dict(self) -> dict[str, Any]:
        module = getattr(self.module, "module", self.module)  # DDP
        return {
            "module": module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        getattr(self.module, "module", self.module).load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])


class Method:
    name: ClassVar[str]
    identity_keys: ClassVar[tuple[str, ...]] = ("steps",)
    teacher_in_loop: ClassVar[bool] = True
    student_inputs: ClassVar[bool] = False
    uses_loss: ClassVar[bool] = True
    reads_x0: ClassVar[bool] = True  # whether a step reads the data's clean latents (trajectory, dmd: its prompts only)
    # Whether it samples the teacher's ODE before training (trajectory; dmd's regression term): data/trajectories.py,
    # through the model's own pipeline (an image-to-video teacher's from each prompt's image).
    samples_ode: bool = False
    # What the model card says the student learned (`{k}`: its K, `{g}`: the teacher's guidance scale).
    card_phrase: ClassVar[str] = (
        "the student transformer was trained with the method `{name}` against the teacher's classifier-free-guided "
        "predictions (guidance scale {g})"
    )

    def __init__(self, name: str, steps: int | None = None):
        if name != self.name:
            raise UserError(f"method.name={name!r} belongs to method={name}; choose the method with method=<name>")
        if steps is not None and steps < 1:
            raise UserError(f"method.steps={steps} must be at least 1 (a K-step student); e.g. method.steps=4")
        self.steps = steps
        self.networks: dict[str, Network] = {}

    def identity(self) -> dict[str, Any]:
        """What a checkpoint of this method records of it: `name` and each of `identity_keys` (`method.<key>`) as
        this method was built with it (an attribute of that name). A resume must match it."""
        return {"name": self.name} | {key: getattr(self, key) for key in self.identity_keys}

    def passes(self, micro_batches: int, whole_step: bool) -> Passes:
        """What one training step runs, in passes of each network (the planner's step time), with the networks it
        trains beside the student (`networks`: the planner's memory counts them too): kd's by default, one teacher
        call per micro-batch (or one per step under trainer.teacher_whole_step) and the student's, no other network."""
        return Passes(self.name, micro_batches, 1 if whole_step else micro_batches, 0.0, micro_batches)

    def check_teacher(self, config: dict[str, Any]) -> None:
        """Refuse a teacher (its transformer's config.json) the networks it trains cannot be shaped for."""

    def check(
        self, placement: Placement, ranks: int, device: torch.device, teacher_cfg: DictConfig | None = None
    ) -> None:
        """Refuse a placement this method cannot train with, naming one it can (`ranks`: processes in all;
        `teacher_cfg`: the `teacher` node, or None). Most take any placement."""

    def prepare(
        self, ctx: RunContext, teacher: Teacher | None, embeddings: PromptEmbeddings, images: ImageBank | None = None
    ) -> None:
        """What the method samples from the teacher once, before the student (every rank calls it). `images`: each
        training prompt's image (an image-to-video teacher's), for a method that draws its own prompts."""

    def bind(
        self,
        ctx: RunContext,
        student: torch.nn.Module,
        trainer_cfg: DictConfig,
        state: dict[str, Any] | None,
        group: Any,
    ) -> None:
        """The networks it trains beside the student, built and (resuming) restored from `state["method"]`. Most
        train none: a checkpoint that holds networks (another method's) is refused, never dropped."""
        if state is not None:
            self.load_state_dict(state.get("method"))

    def other_updates(self, run: Run, step: int) -> dict[str, torch.Tensor]:
        """The updates of its other networks in one training step (before the student's): their logged parts."""
        return {}

    def student_loss(
        self, run: Run, step: int, micro: int, clock: Clock
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], tuple[Any, Any]]:
        """One micro-batch of the student: (loss to backpropagate, logged parts, teacher span)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {name: network.state_dict() for name, network in self.networks.items()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Its networks' states from a checkpoint's `method` entry; one that does not fit (another method's, or
        one trained with other settings, or a checkpoint that records no method) is one UserError line."""
        fix = "resume with the method (and method.* settings) it was trained with, or start a new run folder"
        state = state or {}
        if set(state) != set(self.networks):
            held = f"holds {', '.join(sorted(state))}" if state else "holds no network beside the student"
            trains = ", ".join(self.networks) or "none beside the student"
            raise UserError(
                f"trainer.resume: the checkpoint {held}, and method={self.name} trains {trains} (it was "
                f"trained with another method); {fix}"
            )
        for name, network in self.networks.items():
            try:
                network.load_state_dict(state[name])
            except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as e:
                first = str(e).strip().splitlines()[0][:200].rstrip(":") if str(e).strip() else type(e).__name__
                raise UserError(
                    f"trainer.resume: the checkpoint's {name} does not fit method={self.name}'s "
                    f"({type(e).__name__}: {first}); {fix}"
                ) from None


# A Wan teacher's scheduler has 1000 training timesteps: more sample steps than that only repeat timesteps (and
# `method.teacher_steps=100000000` would allocate its schedule until the kernel killed the process).
MAX_SAMPLE_STEPS = 1000


def steps_within(steps: int, teacher_steps: int) -> int:
    """A few-step student's K: at least 1 and no more than the teacher's own sample steps, themselves at most
    MAX_SAMPLE_STEPS: checked as the method is built, before any work."""
    if teacher_steps < 1:
        raise UserError(f"method.teacher_steps={teacher_steps} must be a positive integer; e.g. 20")
    if teacher_steps > MAX_SAMPLE_STEPS:
        raise UserError(
            f"method.teacher_steps={teacher_steps} is more than a Wan scheduler's {MAX_SAMPLE_STEPS} "
            f"training timesteps; give {MAX_SAMPLE_STEPS} or fewer (e.g. 20)"
        )
    if steps > teacher_steps:
        raise UserError(
            f"method.steps={steps} is more than the teacher's sample steps (method.teacher_steps={teacher_steps}): "
            f"a few-step student takes fewer; lower method.steps or raise method.teacher_steps"
        )
    return steps
