"""The distillation step and the flat training loop."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from wandistiller.checkpoint import save_checkpoint
from wandistiller.data import Batch, PromptEmbeddings, make_batch
from wandistiller.precision import Precision
from wandistiller.student import Student
from wandistiller.teacher import Teacher


@dataclass
class Run:
    """Everything the loop drives, built by `train.run` (runtime objects, not YAML)."""

    student: Student
    teacher: Teacher
    embeddings: PromptEmbeddings
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    ema: object | None
    tracker: object
    precision: Precision
    device: torch.device
    run_dir: Path
    seed: int
    flow_shift: float
    rank: int = 0
    history: list[dict] = field(default_factory=list)


def distill_step(run: Run, batch: Batch, kd_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Teacher targets, student prediction, loss parts: (loss, velocity loss, hidden loss, teacher ms)."""
    start = _now(run.device)
    target, teacher_hidden = run.teacher.targets(
        batch.x_t, batch.t, batch.cond, batch.uncond, want_hidden=kd_weight > 0
    )
    target = target.to(run.device, non_blocking=True)
    teacher_ms = (_now(run.device) - start) * 1e3
    dtype = run.precision.autocast_dtype
    with torch.autocast(run.device.type, dtype=dtype, enabled=dtype is not None):
        pred, student_hidden = run.student(batch.x_t, batch.t, batch.cond)
    velocity_loss = F.mse_loss(pred.float(), target)
    hidden_loss = torch.zeros((), device=run.device)
    if kd_weight > 0:
        hidden_loss = F.mse_loss(student_hidden.float(), teacher_hidden.to(run.device))
    return velocity_loss + kd_weight * hidden_loss, velocity_loss.detach(), hidden_loss.detach(), teacher_ms


def train_loop(run: Run, trainer_cfg, data_cfg, kd_weight: float, start_step: int) -> list[dict]:
    spec = run.teacher.spec
    latent_shape = (
        spec.transformer_config["in_channels"],
        data_cfg.latent_frames,
        data_cfg.latent_height,
        data_cfg.latent_width,
    )
    accum, batch_size = trainer_cfg.grad_accum_steps, trainer_cfg.batch_size
    params = [p for p in run.student.parameters() if p.requires_grad]
    bar = tqdm(
        total=trainer_cfg.max_steps,
        initial=start_step,
        desc="distill",
        disable=not trainer_cfg.progress_bar or run.rank != 0,
    )
    for step in range(start_step, trainer_cfg.max_steps):
        step_start, teacher_ms, sums = _now(run.device), 0.0, torch.zeros(3, device=run.device)
        _reset_peak_memory()
        for micro in range(accum):
            batch = make_batch(
                seed=run.seed,
                step=step,
                micro=micro,
                rank=run.rank,
                batch_size=batch_size,
                latent_shape=latent_shape,
                flow_shift=run.flow_shift,
                num_train_timesteps=spec.num_train_timesteps,
                embeddings=run.embeddings,
            ).to(run.device)
            loss, velocity_loss, hidden_loss, ms = distill_step(run, batch, kd_weight)
            run.scaler.scale(loss / accum).backward()
            sums += torch.stack([loss.detach(), velocity_loss, hidden_loss]) / accum
            teacher_ms += ms
            del batch, loss  # free activations' owners before the next micro-batch
        run.scaler.unscale_(run.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, trainer_cfg.max_grad_norm or float("inf"))
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
        run.lr_scheduler.step()
        if run.ema is not None:
            run.ema.step(params)
        step_ms = (_now(run.device) - step_start) * 1e3
        loss, velocity_loss, hidden_loss = sums.tolist()
        metrics = {
            "loss": loss,
            "loss_velocity": velocity_loss,
            "loss_hidden": hidden_loss,
            "grad_norm": float(grad_norm),
            "lr": run.lr_scheduler.get_last_lr()[0],
            "samples_per_s": batch_size * accum / (step_ms / 1e3),
            "step_ms": step_ms,
            "teacher_ms": teacher_ms,
            "student_ms": step_ms - teacher_ms,
        } | memory_metrics()
        run.history.append({"step": step + 1} | metrics)
        bar.update()
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        if (step + 1) % trainer_cfg.log_every == 0:
            run.tracker.log(metrics, step=step + 1)
        if (step + 1) % trainer_cfg.checkpoint_every == 0 or step + 1 == trainer_cfg.max_steps:
            save_checkpoint(run.run_dir, step + 1, training_state(run), keep=trainer_cfg.keep_checkpoints)
    bar.close()
    return run.history


def training_state(run: Run) -> dict:
    return {
        "student": run.student.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "lr_scheduler": run.lr_scheduler.state_dict(),
        "scaler": run.scaler.state_dict(),
        "ema": run.ema.state_dict() if run.ema is not None else None,
        "tracker_run_id": run.tracker.run_id,
    }


def memory_metrics() -> dict:
    """Peak host RSS and, per visible GPU, peak allocated memory since the last reset (GiB)."""
    metrics = {"host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            metrics[f"gpu{i}_peak_gib"] = torch.cuda.max_memory_allocated(i) / 2**30
    return metrics


def _reset_peak_memory() -> None:
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(i)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
