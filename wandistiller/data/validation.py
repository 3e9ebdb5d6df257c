"""Validation: the student against the teacher on a fixed held-out set, overall and per noise band.

The set is fixed once -- held-out prompts, noise from the run's seed, a grid of timesteps -- and the
teacher is frozen, so its targets are computed once and every later check differs only by the student.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from wandistiller.core.errors import UserError
from wandistiller.core.files import in_run, read_in, write_in_run
from wandistiller.data.prompts import PromptEmbeddings, read_prompts
from wandistiller.teacher.image import ImageCondition, denoised_frames

log = logging.getLogger(__name__)

# Noise bands in timestep space (t of 1000): where detail, composition and layout are decided.
BANDS = {"t<250": (0.0, 250.0), "250-750": (250.0, 750.0), "t>750": (750.0, 1000.0)}


def split_prompts(prompts: list[str], val_prompts_path: str | None, fraction: float = 0.1):
    """(training prompts, held-out prompts): a given file is held out whole (and removed from training);
    otherwise the last `fraction` of the prompts (at least one)."""
    if val_prompts_path is not None:
        try:
            val = read_prompts(val_prompts_path)
        except UserError as e:
            raise UserError(str(e).replace("data.prompts_path", "data.val_prompts_path")) from None
        held = set(val)
        return [p for p in prompts if p not in held] or prompts, val
    if len(prompts) < 2:
        log.warning("one prompt only: validating on the training prompt")
        return prompts, prompts
    n_val = min(len(prompts) - 1, max(1, round(len(prompts) * fraction)))
    return prompts[:-n_val], prompts[-n_val:]


@dataclass
class ValSet:
    """Every (held-out prompt, grid timestep) pair: inputs fixed, targets filled in once."""

    x_t: torch.Tensor  # [N, C, F, H, W]
    t: torch.Tensor  # [N]
    cond: torch.Tensor  # [N, L, D]
    uncond: torch.Tensor  # [N, L, D]
    targets: torch.Tensor | None = None  # [N, C, F, H, W] float32, the teacher's guided velocity
    image: ImageCondition | None = None  # each row's held-out image (an image-to-video teacher's); None: text alone

    def rows(self, i: int, n: int) -> tuple:
        """(x_t, t, cond, uncond, image) of rows i..i+n: a teacher's or a student's inputs."""
        image = None if self.image is None else self.image.select(slice(i, i + n))
        return (*(v[i : i + n] for v in (self.x_t, self.t, self.cond, self.uncond)), image)


def timestep_grid(n: int, num_train_timesteps: int = 1000) -> torch.Tensor:
    """n timesteps at the centres of n equal bins: every band gets points, none sits on a band edge."""
    return (torch.arange(n, dtype=torch.float32) + 0.5) * (num_train_timesteps / n)


def build_val_set(
    embeddings: PromptEmbeddings,
    latent_shape: tuple[int, int, int, int],
    seed: int,
    num_train_timesteps: int = 1000,
    timesteps: int = 8,
    latent_bank=None,
    images=None,
) -> ValSet:
    """x_t = (1 - t/T) x0 + (t/T) noise for every held-out prompt and grid timestep.

    x0 is Gaussian, or (with a LatentBank over these prompts) each prompt's first teacher latent or image,
    so validation sees the inputs training sees. `images` (an ImageBank over these prompts): each row's image.
    """
    n_prompts = len(embeddings.prompts)
    digest = hashlib.blake2b(repr(("validation", seed)).encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    t = timestep_grid(timesteps, num_train_timesteps).repeat(n_prompts)
    prompt_idx = torch.arange(n_prompts).repeat_interleave(timesteps)
    noise = torch.randn((len(t), *latent_shape), generator=g)  # first: the same noise whatever x0 is
    if latent_bank is None:
        x0 = torch.randn((n_prompts, *latent_shape), generator=g)
    else:
        first = [int((latent_bank.prompt_idx == i).nonzero()[0]) for i in range(n_prompts)]
        x0 = latent_bank.x0(torch.tensor(first))
    s = (t / num_train_timesteps).view(-1, 1, 1, 1, 1)
    return ValSet(
        x_t=(1 - s) * x0[prompt_idx] + s * noise,
        t=t,
        cond=embeddings.padded(prompt_idx),
        uncond=embeddings.negative_batch(len(t)).contiguous(),
        image=None if images is None else images.select(prompt_idx),
    )


def fill_targets(val_set: ValSet, teacher_targets_fn, batch_size: int = 8) -> ValSet:
    """The teacher's targets, once: `teacher_targets_fn(x_t, t, cond, uncond) -> velocity` (e.g. a
    Teacher's `lambda *a: teacher.targets(*a)[0]`), given `image=` where the set holds images. A rank without a
    teacher receives them instead."""
    if val_set.targets is None:
        parts = []
        for i in range(0, len(val_set.t), batch_size):
            *inputs, image = val_set.rows(i, batch_size)
            parts.append(teacher_targets_fn(*inputs) if image is None else teacher_targets_fn(*inputs, image=image))
        val_set.targets = torch.cat([p.float().cpu() for p in parts])
    return val_set


@torch.no_grad()
def val_loss(
    student: torch.nn.Module,
    teacher_targets_fn,
    val_set: ValSet,
    batch_size: int = 8,
    device: torch.device | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """`val/loss` (velocity MSE over the set) and `val/loss_<band>` per noise band.

    `student(x_t, t, cond) -> (pred, hidden)` (the Student wrapper, unwrapped from DDP). Runs in eval
    mode and restores the student's mode after.
    """
    fill_targets(val_set, teacher_targets_fn, batch_size)
    assert val_set.targets is not None  # filled just above
    device = device or next(student.parameters()).device
    was_training = student.training
    student.eval()
    errors = []
    for i in range(0, len(val_set.t), batch_size):
        x_t, t, cond, _, image = val_set.rows(i, batch_size)
        x_t, t, cond = x_t.to(device), t.to(device), cond.to(device)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            pred = student(x_t, t, cond)[0] if image is None else student(x_t, t, cond, image.to(device))[0]
        target = val_set.targets[i : i + batch_size].to(device)
        error = denoised_frames(image, pred.float() - target)  # TI2V's given first frame counts as in training
        errors.append((error**2).flatten(1).mean(1).cpu())
    student.train(was_training)
    per_sample = torch.cat(errors).double()
    metrics = {"val/loss": float(per_sample.mean())}
    for name, (lo, hi) in BANDS.items():
        in_band = (val_set.t >= lo) & (val_set.t < hi)
        if in_band.any():
            metrics[f"val/loss_{name}"] = float(per_sample[in_band].mean())
    return metrics


def recorded_rows(run_dir: Path) -> list[dict]:
    """metrics_steps.jsonl's rows: training steps and validations, as they happened ([] without the file)."""

    path = in_run(run_dir, "metrics_steps.jsonl")  # a received folder's link out of it is refused, never read
    rows = []
    text = read_in(run_dir, path).decode(errors="replace") if path.is_file() else ""
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line a killed process left half-written: what it held is lost, not the run
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def drop_rows_after(run_dir: Path, step: int) -> None:
    """metrics_steps.jsonl without the rows past `step`, the checkpoint a run resumes from (or 0): those steps are
    trained again, and a killed segment's rows (or those after a damaged checkpoint passed over) would stand twice
    in the file and in loss.png. Rewritten whole, and only where something goes."""

    path = in_run(run_dir, "metrics_steps.jsonl")
    if not path.is_file():
        return
    lines = read_in(run_dir, path).decode(errors="replace").splitlines(keepends=True)
    kept = [line for line in lines if line.endswith("\n") and _at_or_before(line, step)]
    if len(kept) != len(lines):
        write_in_run(run_dir, path.name, "".join(kept))


def _at_or_before(line: str, step: int) -> bool:
    try:
        row = json.loads(line)
    except ValueError:  # a line a killed process left half-written
        return False
    return not isinstance(row, dict) or not isinstance(row.get("step"), int) or row["step"] <= step


def save_loss_plot(run_dir: str | os.PathLike, extra_rows: Sequence[dict] = ()) -> Path:
    """`loss.png` from `metrics_steps.jsonl` (plus rows not yet written): training loss and the validation
    curves, overall and per band. Drawn on a Figure of its own (not pyplot's: the caller's backend and figures are
    left alone) and replaced atomically, so a reader never sees half a PNG."""
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    rows = list(extra_rows)
    rows = recorded_rows(run_dir) + rows  # a torn line skipped
    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.subplots()
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    if train:
        ax.plot(*zip(*train), lw=1, alpha=0.6, label="train loss")
    styles: dict[str, dict[str, Any]] = {"val/loss": dict(lw=2, color="black")}
    styles |= {f"val/loss_{b}": dict(lw=1, ls="--") for b in BANDS}
    for key, style in styles.items():
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), marker="o", ms=3, label=key, **style)
    ax.set(xlabel="step", ylabel="velocity MSE", yscale="log", title=run_dir.name)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = run_dir / "loss.png"
    write_in_run(run_dir, "loss.png", write=lambda f: fig.savefig(f, format="png"), fsync=False)
    return out
