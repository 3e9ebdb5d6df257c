"""The distillation step and the flat training loop (the same on 1 process or N)."""

from __future__ import annotations

import contextlib
import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from wandistiller.core.errors import UserError
from wandistiller.core.precision import Precision
from wandistiller.core.stopping import install as catch_stop_signals
from wandistiller.data.batches import Batch
from wandistiller.recipe.losses import Loss, LossInputs, as_loss, logged, total
from wandistiller.recipe.methods import REGISTRY
from wandistiller.state.checkpoint import list_checkpoints, save_checkpoint
from wandistiller.teacher.image import denoised_frames

if TYPE_CHECKING:
    from diffusers.training_utils import EMAModel

    from wandistiller.recipe.methods import Method
    from wandistiller.recipe.targets import LocalTargets, RemoteTargets
    from wandistiller.tracking.loggers.base import Logger


@dataclass
class Run:
    """Everything the loop drives, built by the recipe (runtime objects, not YAML)."""

    model: torch.nn.Module  # the Student, DDP-wrapped when several ranks train
    targets: LocalTargets | RemoteTargets  # OwnerTargets is a LocalTargets
    batch_fn: Callable[[int, int, int], Batch]  # (step, micro, dp_rank) -> Batch
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    ema: EMAModel | None
    tracker: Logger
    precision: Precision
    device: torch.device
    run_dir: Path
    # `trainer.loss` through losses.as_loss: LossInputs -> named parts, with `needs` (None: distillation).
    loss_fn: Loss | None = None
    dp_rank: int = 0
    is_main: bool = True
    student_group: dist.ProcessGroup | None = None  # process group of the training ranks (None: no reduction)
    history: list[dict] = field(default_factory=list)
    # Called as hook(run, step) after each step (validation, samples, metrics as they happen: recipe/hooks/).
    hooks: list[Callable] = field(default_factory=list)
    teacher: dict | None = None  # what each checkpoint records of the teacher (checkpoint.teacher_record)
    # `method=`: what one step does (wandistiller/recipe/methods/); None: kd, the teacher's target at the data's batch.
    method: Method | None = None

    @property
    def student(self) -> torch.nn.Module:
        return getattr(self.model, "module", self.model)


def distill_step(run: Run, step: int, micro: int, batch: Batch, clock: Clock | None = None):
    """Teacher targets, student prediction, loss parts: (loss, logged parts, teacher span).

    The loss's `needs` alone decides what runs: the teacher (and after which blocks it returns hidden states)
    where the loss asks for it, or where another rank waits for the call. The teacher span is a pair of `clock`
    marks around the targets, read only when the loop logs.
    """
    clock = clock or Clock(run.device)
    loss_fn = run.loss_fn if run.loss_fn is not None else as_loss(None)
    needs = loss_fn.needs
    start = clock.mark()
    target = teacher_hidden = None
    if needs.teacher_runs or not run.targets.skippable:
        target, teacher_hidden = run.targets.get(step, micro, batch, needs.teacher_hidden)
        target = target.to(run.device, non_blocking=True)
    teacher_span = (start, clock.mark())
    dtype = run.precision.autocast_dtype
    with torch.autocast(run.device.type, dtype=dtype, enabled=dtype is not None):
        pred, student_hidden = run.model(batch.x_t, batch.t, batch.cond, batch.image)
    hidden = tuple(teacher_hidden) if teacher_hidden is not None else None  # one per layer
    # TI2V's given first frame is no prediction: its loss does not count (the rest of any other layout's does).
    pred, target, x0, noise = (
        None if x is None else denoised_frames(batch.image, x) for x in (pred, target, batch.x0, batch.noise)
    )
    assert pred is not None  # the student's, always
    parts = loss_fn(LossInputs(pred, student_hidden, target, hidden, x0, noise, batch.t))
    return total(parts), logged(parts), teacher_span


def train_loop(run: Run, trainer_cfg, start_step: int) -> list[dict]:
    accum, batch_size, last = trainer_cfg.grad_accum_steps, trainer_cfg.batch_size, trainer_cfg.max_steps
    world = dist.get_world_size(run.student_group) if run.student_group is not None else 1
    params = [p for p in run.model.parameters() if p.requires_grad]
    clock, pending = Clock(run.device), []
    bar = tqdm(total=last, initial=start_step, desc="distill", disable=not trainer_cfg.progress_bar or not run.is_main)
    stop = catch_stop_signals()
    method = run.method if run.method is not None else default_method()
    for step in range(start_step, last):
        step_start, spans = clock.mark(), []
        _reset_peak_memory()
        # The method's other networks first (dmd's fake score); their parts are logged beside the student's.
        sums: dict[str, torch.Tensor] = dict(method.other_updates(run, step))
        for micro in range(accum):
            # DDP all-reduces gradients on the last micro-batch only.
            sync = micro == accum - 1 or not hasattr(run.model, "no_sync")
            # nn.Module.__getattr__ is typed Tensor | Module: this is DDP's no_sync method.
            with contextlib.nullcontext() if sync else run.model.no_sync():  # type: ignore[operator]
                loss, parts, span = method.student_loss(run, step, micro, clock)
                run.scaler.scale(loss / accum).backward()
            for name, value in parts.items():  # averaged over micro-batches, still on the device
                sums[name] = sums.get(name, 0) + value.float() / accum
            spans.append(span)
            del loss  # free activations' owners before the next micro-batch
        run.scaler.unscale_(run.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            params, trainer_cfg.max_grad_norm or float("inf"), foreach=run.device.type == "cuda" or None
        )
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
        lr = run.lr_scheduler.get_last_lr()[0]  # the LR this step trained at (after step(): the next one's)
        run.lr_scheduler.step()
        if run.ema is not None:
            run.ema.step(params)
        # Losses stay on the device and times on the device's timeline until the next log: no sync per step.
        copy_ms = run.targets.copy_ms()
        pending.append(_Pending(step + 1, sums, grad_norm, (step_start, clock.mark()), spans, lr, copy_ms))
        bar.update()
        stopping = stop.requested(run.student_group)  # SIGTERM/Ctrl-C on any rank: all stop after this step
        checkpoint = (step + 1) % trainer_cfg.checkpoint_every == 0 or step + 1 == last or stopping
        if (step + 1) % trainer_cfg.log_every == 0 or checkpoint:  # the same steps on every rank
            fresh = _materialize(pending, clock, world * batch_size * accum, run.student_group)
            _stop_if_not_finite(run, fresh)  # before this step's checkpoint: the last good one is kept
            run.history += fresh
            pending = []
            bar.set_postfix(loss=f"{run.history[-1]['loss']:.4f}", refresh=False)
            if run.is_main and (step + 1) % trainer_cfg.log_every == 0:
                run.tracker.log({k: v for k, v in run.history[-1].items() if k != "step"}, step=step + 1)
        if run.is_main and checkpoint:
            save_checkpoint(run.run_dir, step + 1, training_state(run), keep=trainer_cfg.keep_checkpoints)
        for hook in run.hooks:
            hook(run, step + 1)
        if stopping:
            bar.close()  # its last line ended: the "to continue, run …" line then stands on a line of its own
            stop.exit(run.run_dir, step + 1, run.is_main)
    stop.restore()
    run.targets.finish()
    bar.close()
    return run.history


def _stop_if_not_finite(run: Run, entries: list[dict]) -> None:
    """Training that went non-finite learns nothing more: stop at the first such step, naming it and the
    keys that usually cause it. Under an fp16 GradScaler an inf gradient is routine (the step is skipped)."""
    for e in entries:
        bad = [k for k in ("loss", "grad_norm") if not math.isfinite(e[k])]
        if bad == ["grad_norm"] and run.scaler.is_enabled():
            continue
        if bad:
            kept = list_checkpoints(run.run_dir)
            resume = f"the last good checkpoint is {kept[-1].name}" if kept else "no checkpoint was saved"
            raise UserError(
                f"training went non-finite at step {e['step']} (loss {e['loss']}, grad norm {e['grad_norm']}, lr "
                f"{e['lr']:g}); likely trainer.optimizer.lr, teacher.flow_shift, trainer.loss.hidden_kd_weight or "
                f"trainer.max_grad_norm -- {resume}; lower the value and start again, or resume from it"
            )


class Clock:
    """Marks on the device's timeline: CUDA events, which recording never waits for and which are read
    only at logging (one synchronize per log), or perf_counter on a CPU, where nothing runs ahead."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def wait(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


@dataclass
class _Pending:
    """One finished step whose numbers are still on the device (losses, norm) or the timeline (marks)."""

    step: int
    sums: dict[str, torch.Tensor]  # loss and loss_<part>, averaged over micro-batches
    grad_norm: torch.Tensor
    span: tuple
    teacher_spans: list
    lr: float | torch.Tensor  # get_last_lr's: a tensor where the optimizer's lr is one
    copy_ms: float | None
    memory: dict = field(default_factory=lambda: memory_metrics())  # host-side allocator stats: no sync


def _materialize(pending: list[_Pending], clock: Clock, samples_per_step: int, group) -> list[dict]:
    """The metrics of the steps in `pending`: one synchronize, one small all-reduce, one copy to the host."""
    clock.wait()
    names = list(pending[0].sums)  # the same parts every step, in the same order, on every rank
    device = pending[0].sums[names[0]].device
    times = [[sum(clock.ms(*s) for s in p.teacher_spans), clock.ms(*p.span)] for p in pending]
    sums = torch.stack([torch.stack([p.sums[n] for n in names]) for p in pending])
    # Loss parts and timings averaged over the training ranks.
    stats = torch.cat([sums, torch.tensor(times, device=device)], dim=1)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
        stats /= dist.get_world_size(group)
    norms = torch.stack([p.grad_norm.detach().to(device, torch.float32) for p in pending]).view(-1, 1)
    rows = torch.cat([stats, norms], dim=1).tolist()
    entries = []
    for p, row in zip(pending, rows):
        *losses, teacher_ms, step_ms, grad_norm = row
        entry = (
            {"step": p.step}
            | dict(zip(names, losses))
            | {
                "grad_norm": grad_norm,
                "lr": p.lr,
                "samples_per_s": samples_per_step / (max(step_ms, 1e-3) / 1e3),  # a clock that did not move: no /0
                "step_ms": step_ms,
                "teacher_ms": teacher_ms,
                "student_ms": step_ms - teacher_ms,
            }
            | p.memory
        )
        if p.copy_ms is not None:  # streamed teachers: time spent copying weights (overlapped with compute)
            entry["copy_ms"] = p.copy_ms
        entries.append(entry)
    return entries


def default_method() -> Method:
    """`method=kd`, plain distillation (conf/train.yaml's default): what a Run built without one trains with."""

    return REGISTRY.get("kd").build()


def training_state(run: Run) -> dict:
    method = run.method if run.method is not None else default_method()
    # The method's other networks and their optimizers (dmd's fake score), where it trains any.
    others = method.state_dict()
    return ({"method": others} if others else {}) | {
        "method_identity": method.identity(),  # its name and settings: a resume under others is refused
        "student": run.student.state_dict(),
        # A LoRA student's rank, alpha and layers (student/lora.py): a resume under others is refused.
        "student_identity": getattr(run.student, "identity", lambda: None)(),
        "optimizer": run.optimizer.state_dict(),
        "lr_scheduler": run.lr_scheduler.state_dict(),
        "scaler": run.scaler.state_dict(),
        "ema": run.ema.state_dict() if run.ema is not None else None,
        "tracker_run_id": run.tracker.run_id,
        "teacher": run.teacher,
    }


def memory_metrics() -> dict:
    """Peak host RSS and, per visible GPU, peak allocated memory since the last reset (GiB)."""
    metrics = {"host_peak_rss_gib": _peak_rss_kib() / 2**20}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            metrics[f"gpu{i}_peak_gib"] = torch.cuda.max_memory_allocated(i) / 2**30
    return metrics


def _peak_rss_kib() -> int:
    """This process's own peak RSS (VmHWM). Not ru_maxrss: Linux carries the launching process's high-water
    mark over exec into it, so a job started from a big process (a sweep, pytest) reported that one's."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # not Linux: the best there is


def _reset_peak_memory() -> None:
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(i)
