"""Where the package's shipped assets lie (prompts, the pocket teachers, built-in files)."""

from __future__ import annotations

from pathlib import Path

# The package's shipped assets (prompts, built-in files); one constant so no module imports another for a path.
ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_PROMPTS = ASSETS / "prompts.txt"
