"""User-facing mistakes: one clear line, a non-zero exit, no traceback."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Iterator
from typing import NoReturn


class UserError(Exception):
    """A mistake the user can fix; the message names the key and the fix."""


class Stopped(Exception):
    """A run stopped on request (SIGTERM, Ctrl-C) after saving a checkpoint; the message says how to resume."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


EXIT_USER_ERROR = 2


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    try:
        yield
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    except Stopped as e:
        if str(e):  # the main rank's; the other ranks stop silently
            print(str(e), file=sys.stderr, flush=True)
        sys.exit(e.exit_code)


@contextlib.contextmanager
def internal_errors_reported() -> Iterator[None]:
    """An unexpected exception -- a bug, not a mistake of the user's -- is one line on the terminal that
    says how to report it; its traceback goes into the run's log file (train.log). HYDRA_FULL_ERROR=1
    (Hydra's own switch for full tracebacks) lets it through untouched, for developers."""
    try:
        yield
    except Exception as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or isinstance(e, (UserError, Stopped)):
            raise
        logs = write_to_log_files("internal error", exc_info=sys.exc_info())
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if logs:
            report = f"with train.log (the traceback is in {logs[0]}); HYDRA_FULL_ERROR=1 shows it here"
        else:  # a tool without a log file (eval, generate): the traceback is all there is to report
            traceback.print_exc()
            report = "with the traceback above"
        print(f"internal error: {type(e).__name__}: {first} -- please report it {report}", file=sys.stderr, flush=True)
        sys.exit(1)


@contextlib.contextmanager
def quieted(name: str, level: int = logging.WARNING) -> Iterator[None]:
    """Logger `name` (and its children) silent below `level` for the block: a library's lines, or ours,
    that the block's own outcome would contradict or repeat."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def write_to_log_files(message: str, exc_info=None, name: str = "wandistiller") -> list[str]:
    """Log `message` to the log files alone (Hydra's train.log), not the terminal; returns their paths."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    record = logging.getLogger(name).makeRecord(
        name, logging.INFO if exc_info is None else logging.ERROR, "", 0, message, (), exc_info
    )
    for handler in files:
        handler.handle(record)
    return [h.baseFilename for h in files]


def whole_number(text: str, option: str, least: int | None = 1, example: int = 4) -> int:
    """A command-line count (steps, a limit, a seed), read after argparse: a whole number of `least` or more
    (None: any), else one `error:` line naming the option and the fix (exit 2, no usage block)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or (least is not None and value < least):
        what = f"{text!r} is not a whole number" if value is None else f"{value} is not {least} or more"
        wanted = "a whole number" + (f" of {least} or more" if least is not None else "")
        raise UserError(f"{option} {what}; give {wanted}, e.g. {option} {example}")
    return value


class OneLineParser(argparse.ArgumentParser):
    """argparse whose refusals (an unknown option, a missing argument, a value not among the choices) are one
    `error:` line and exit 2, as every other mistake is, not its usage block; `--help` is as before. A flag is
    its whole name: an abbreviation (`--ou` for `--out`) was taken silently, its value given to another flag than
    meant where two share a start."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}; {self.prog} --help lists the options", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)


def description(doc: str | None) -> str:
    """A CLI's `--help` description: its module docstring's first paragraph, whole (one line of it may stop
    mid-sentence)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def clipped(text: str, most: int = 800) -> str:
    """`text` of at most about `most` characters for a one-line message: a long one keeps its start and its end (a
    reason after a long path: "... leads out of the run folder"), its middle elided."""
    if len(text) <= most:
        return text
    half = most // 2
    return f"{text[:half]}…{text[-half:]}"


def human_count(n: int) -> str:
    """A parameter count a person reads at a glance: 41888 -> "41.9K", 213_000_000 -> "213M", 1.3e9 -> "1.3B"."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size * 0.9995:  # 999,999 reads "1M", not "1e+03K"
            value = n / size
            return f"{value:.3g}{unit}" if value < 1000 else f"{value:.0f}{unit}"
    return str(n)


def counted(n: int, noun: str) -> str:
    """A count and its noun, singular at 1: "1 step", "4 steps", "1 network call"."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def rate(x: float | None) -> str:
    """A rate to three significant figures, never rounded to nothing: 0.0123 -> "0.0123", 41.27 -> "41.3",
    1234.5 -> "1234" (a slow run's samples/s read "0.0" at one decimal)."""
    if not x:
        return "0"
    text = f"{x:.3g}"
    return f"{x:.0f}" if "e+" in text or abs(x) >= 1000 else text


class WorkerFailed(UserError):
    """A worker died (an error, an out-of-memory, a kill); its traceback was printed above."""


class RunDirTaken(UserError):
    """The run folder holds another run's outputs, or another live run."""
