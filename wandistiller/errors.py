"""User-facing mistakes: one clear line, a non-zero exit, no traceback."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


class UserError(Exception):
    """A mistake the user can fix; the message names the key and the fix."""


EXIT_USER_ERROR = 2


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    try:
        yield
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
