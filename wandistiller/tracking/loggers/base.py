"""The interface every logger implements (`logger: [wandb, tensorboard, csv]` runs several at once).

A logger is one module of this package holding its config schema (a dataclass with `_target_`) and its class,
named in the module's `OPTION = (Config, Class)`; the registry (`__init__.py`) finds it, so a new logger is that
module plus its YAML in `conf/logger/` and no other edit. Every method has a do-nothing default:

    check(node, key)         refuse early (before the run folder is claimed) in one line, naming the fix
    start(run_dir, config, run_id, group, name, start_step)
                             on the main rank, once; `run_id` continues a resumed run, whose checkpoint was
                             saved at `start_step`: what a killed segment logged after it is dropped (None: a
                             later process adding to a finished run, e.g. an evaluation; nothing is dropped)
    log(metrics, step)       one dict of floats per log step (already on the host: no sync of its own)
    log_image(key, path, step)                       a PNG the run wrote (sample grids)
    finish(summary)          metrics.json's numbers at the end (also closes)
    close()                  flush and release files; called however the run ends (a stop, a crash), twice is fine
    report(sweep_dir, columns, rows, png, group)     a finished sweep's comparison table
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import DictConfig


class Logger:
    # The option's name in messages; the registry keys options by module name, not by this.
    name: ClassVar[str] = ""
    # An id a resumed run continues (saved in each checkpoint as `tracker_run_id`); None: nothing to continue.
    run_id: str | None = None

    def __init__(self, **_: object):
        pass

    @classmethod
    def reopened(cls, node: DictConfig, run_id: str | None, mode: str | None = None) -> DictConfig | None:
        """This logger's saved node as a later process (an evaluation of the run) reopens it to add to the run's
        own records, or None where it would only start a stray one. A file logger appends to its files as it is."""
        return node

    @classmethod
    def check(cls, node: DictConfig, key: str) -> None:
        """Refuse settings that would fail only after the teacher loaded (one UserError line)."""

    def start(
        self,
        run_dir: Path,
        config: dict[str, Any],
        run_id: str | None,
        group: str | None = None,
        name: str | None = None,
        start_step: int | None = None,
    ) -> None:
        pass

    def log(self, metrics: dict[str, Any], step: int | None) -> None:
        pass

    def log_image(self, key: str, path: Path, step: int | None) -> None:
        pass

    def log_video(self, key: str, path: Path, step: int | None) -> None:
        """An animated clip (a GIF, its still strip beside it as `<stem>.png`); a logger without video shows the
        strip."""
        self.log_image(key, Path(path).with_suffix(".png"), step)

    def finish(self, summary: dict[str, Any]) -> None:
        pass

    def report(self, sweep_dir: Path, columns: list[str], rows: list[list[str]], png: Path, group: str) -> None:
        pass

    def close(self) -> None:
        pass


# The logger a pre-release config names (core/renamed.py); `logger=[]` runs no logger.
NullTracker = Logger


class Loggers(Logger):
    """Every configured logger behind one: each call goes to all of them, in the config's order. One logger
    failing does not keep the others from their call: each runs, then the first error is raised. A logger
    whose start fails leaves none open: those already started are closed first."""

    name = "loggers"

    def __init__(self, loggers: list[Logger]):
        self.loggers = list(loggers)

    @property
    def run_id(self) -> str | None:  # type: ignore[override]  # the list's id is its loggers': read, never set
        return next((lg.run_id for lg in self.loggers if lg.run_id is not None), None)

    def start(
        self,
        run_dir: Path,
        config: dict[str, Any],
        run_id: str | None,
        group: str | None = None,
        name: str | None = None,
        start_step: int | None = None,
    ) -> None:
        for i, lg in enumerate(self.loggers):
            # A logger of the user's own written before start_step existed is started as it was then.
            extra = {"start_step": start_step} if _takes(lg.start, "start_step") else {}
            try:
                lg.start(run_dir, config, run_id, group=group, name=name, **extra)
            except BaseException:
                _each(self.loggers[:i], _close)
                raise

    def log(self, metrics: dict[str, Any], step: int | None) -> None:
        _each(self.loggers, lambda lg: lg.log(metrics, step))

    def log_image(self, key: str, path: Path, step: int | None) -> None:
        _each(self.loggers, lambda lg: lg.log_image(key, path, step))

    def log_video(self, key: str, path: Path, step: int | None) -> None:
        # a logger of the user's own written before clips existed shows the still strip
        def one(lg: Logger) -> None:
            video = getattr(lg, "log_video", None)
            if callable(video):
                video(key, path, step)
            else:
                lg.log_image(key, Path(path).with_suffix(".png"), step)

        _each(self.loggers, one)

    def finish(self, summary: dict[str, Any]) -> None:
        _each(self.loggers, lambda lg: lg.finish(summary))

    def close(self) -> None:
        _each(self.loggers, _close)

    def report(self, sweep_dir: Path, columns: list[str], rows: list[list[str]], png: Path, group: str) -> None:
        _each(self.loggers, lambda lg: lg.report(sweep_dir, columns, rows, png, group))


def _close(lg: Logger) -> None:
    close = getattr(lg, "close", None)  # a logger of the user's own need not subclass Logger
    if callable(close):
        close()


def _takes(method: Callable[..., object], name: str) -> bool:
    params = inspect.signature(method).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _each(items: list[Logger], call: Callable[[Logger], object]) -> None:
    """`call` on every logger, even after one raised; then the first error is raised (later ones logged)."""

    first = None
    for lg in items:
        try:
            call(lg)
        except Exception as e:
            if first is None:
                first = e
            else:
                log = logging.getLogger(__name__)
                log.error("logger %s also failed: %s: %s", type(lg).__name__, type(e).__name__, e)
    if first is not None:
        raise first
