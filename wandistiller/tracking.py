"""Experiment tracking: wandb (offline unless asked) or nothing. Rank 0 only."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class NullTracker:
    run_id: str | None = None

    def __init__(self, **_: object):
        pass

    def start(
        self, run_dir: Path, config: dict, run_id: str | None, group: str | None = None, name: str | None = None
    ) -> None:
        pass

    def log(self, metrics: dict, step: int) -> None:
        pass

    def log_image(self, key: str, path: Path, step: int) -> None:
        pass

    def finish(self, summary: dict) -> None:
        pass


class WandbTracker(NullTracker):
    """One wandb run per training run; a resumed run continues the same run id."""

    def __init__(
        self,
        project: str,
        entity: str | None = None,
        mode: str = "offline",
        group: str | None = None,
        name: str | None = None,
        tags: list[str] | None = None,
    ):
        self.kwargs = dict(project=project, entity=entity, mode=mode, group=group, name=name, tags=list(tags or []))
        self.run = None

    def start(
        self, run_dir: Path, config: dict, run_id: str | None, group: str | None = None, name: str | None = None
    ) -> None:
        """`group`/`name` (a sweep and its point) fill in what the logger config leaves null."""
        # Offline wandb still sends crash reports unless told not to.
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        kwargs = self.kwargs | {"group": self.kwargs["group"] or group, "name": self.kwargs["name"] or name}
        self.run = wandb.init(dir=str(run_dir), config=config, id=run_id, resume="allow" if run_id else None, **kwargs)
        self.run_id = self.run.id

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def log_image(self, key: str, path: Path, step: int) -> None:
        import wandb

        self.run.log({key: wandb.Image(str(path))}, step=step)

    def finish(self, summary: dict) -> None:
        self.run.summary.update(summary)
        offline_dir = Path(self.run.dir).parent
        self.run.finish()
        if self.kwargs["mode"] == "offline":
            log.info("wandb: offline run saved; upload it with: wandb sync %s", offline_dir)
