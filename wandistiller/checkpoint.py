"""Atomic checkpoints: written to a temporary folder, then renamed, so a crash never leaves a torn one."""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from wandistiller.errors import UserError

CHECKPOINTS = "checkpoints"
STATE_FILE = "state.pt"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step_{step:08d}"


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint was taken at: from its folder name, or (a renamed folder) from its state."""
    if re.fullmatch(r"step_\d+", path.name):
        return int(path.name[len("step_") :])
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)["step"]


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders start with '.' and are skipped)."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file())


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, state: dict, keep: int) -> Path:
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / STATE_FILE, "wb") as f:
        torch.save(state | {"step": step, "rng": rng_state()}, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # the same step saved again after a resume: replace it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    """trainer.resume: None (new run), 'auto' (latest checkpoint in this run folder, if any), or a folder."""
    if resume is None:
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume).expanduser()
    if (path / STATE_FILE).is_file():
        return path
    found = list_checkpoints(path)  # a run folder: take its latest
    if found:
        return found[-1]
    raise UserError(
        f"trainer.resume={resume!r} is neither a checkpoint folder (holding {STATE_FILE}) nor a run folder with "
        "checkpoints; use trainer.resume=auto or a path under <run>/checkpoints/"
    )


def load_checkpoint(path: Path) -> dict:
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    set_rng_state(state["rng"])
    return state
