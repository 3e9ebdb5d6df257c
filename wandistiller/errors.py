"""User-facing mistakes: one clear line, a non-zero exit, no traceback."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


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
