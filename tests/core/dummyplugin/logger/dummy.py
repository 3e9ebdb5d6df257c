"""`logger=[dummy]`: each logged step's loss as one line of the run folder's `dummy.txt`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from wandistiller.core.registry import Option
from wandistiller.tracking.loggers.base import Logger


@dataclass
class DummyLoggerConfig:
    _target_: str = "dummyplugin.logger.dummy.DummyLogger"
    file: str = "dummy.txt"


class DummyLogger(Logger):
    name = "dummy"

    def __init__(self, *, file: str):
        self.file, self.path = file, Path(file)

    def start(
        self,
        run_dir: Path,
        config: dict,
        run_id: str | None,
        group: str | None = None,
        name: str | None = None,
        start_step: int | None = None,
    ) -> None:
        self.path = Path(run_dir) / self.file

    def log(self, metrics: dict, step: int | None) -> None:
        if "loss" in metrics:
            with self.path.open("a") as f:
                f.write(f"{step} {metrics['loss']}\n")


OPTION = Option("dummy", DummyLoggerConfig, DummyLogger)
