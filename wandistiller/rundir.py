"""The run folder: claimed once, before any output is written, and never written over."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from omegaconf import OmegaConf

from wandistiller.checkpoint import list_checkpoints, resolve_resume
from wandistiller.errors import UserError


class RunDirTaken(UserError):
    """The run folder holds another run's outputs (and this run does not continue it)."""


def claim_run_dir(run_dir: Path, resume: str | None) -> Path | None:
    """Refuse to write over another run's outputs; return the checkpoint to resume from, if any."""
    finished = [p.name for p in (run_dir / "metrics.json", run_dir / "student") if p.exists()]
    earlier = list_checkpoints(run_dir)
    if (earlier or finished) and resume != "auto":
        what = f"checkpoints up to {earlier[-1].name}" if earlier else " and ".join(finished)
        raise RunDirTaken(
            f"the run folder {run_dir} already holds another run's outputs ({what}); "
            "add trainer.resume=auto to continue it, or choose a new folder with hydra.run.dir=…"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    return resolve_resume(resume, run_dir)


def save_config(run_dir: Path, cfg, resume_from: Path | None) -> None:
    """The composed config, as Hydra would write it; a resumed run keeps the first run's and adds its own."""
    from hydra.core.hydra_config import HydraConfig

    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(exist_ok=True)
    name = "config.yaml" if not (hydra_dir / "config.yaml").exists() else f"config_resume_{int(time.time())}.yaml"
    OmegaConf.save(cfg, hydra_dir / name)
    if HydraConfig.initialized() and name == "config.yaml":
        OmegaConf.save(HydraConfig.get().overrides.task, hydra_dir / "overrides.yaml")


@contextlib.contextmanager
def removed_if_refused(run_dir: Path) -> Iterator[None]:
    """A run refused before it wrote anything leaves no folder behind: Hydra creates the folder (and its
    log) before the job starts, so on a refusal a folder holding nothing but that log is removed."""
    try:
        yield
    except UserError:
        leftovers = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else {"-"}
        if leftovers <= {"train.log"}:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
