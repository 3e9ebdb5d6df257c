"""The interface every loop hook implements: `hook(run, step)` after each step's optimizer update and
checkpoint, the same steps on every rank (the loop itself knows none of them).

A hook is one module of this package defining `OPTION = Option("<name>", <Name>Config, <Name>Hook)`; the registry
(`__init__.py`) finds it, so a new hook is that module plus its YAML in `conf/hooks/` (added to the list
`hooks=[monitor,progress,samples,evaluate,collapse,<name>]`), and no other edit. Its settings are its own schema's keys,
under `hooks.<name>` (`hooks.monitor.val_every=25`), given to its constructor, which refuses a bad one:

    main_only          runs on the main training rank only (the default), or on every training rank
    check(cfg)         before any work: a setting the rest of the config makes impossible, refused in one line
    bind(ctx, parts)   once before the loop: the run's frozen context and what setup built for hooks
    __call__(run, step)   after each step (`step` counts finished steps: 1 after the first)
    at_end(run) -> dict   once, after the last step's outputs (student, samples): figures for metrics.json
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from wandistiller.core.errors import UserError
from wandistiller.recipe.methods.base import MAX_SAMPLE_STEPS

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig

    from wandistiller.data.validation import ValSet
    from wandistiller.recipe.context import RunContext
    from wandistiller.recipe.loop import Run


@dataclass(frozen=True)
class HookParts:
    """What setup built that hooks may use: the held-out set (None: no validation) and the sample grid's
    drawer, `samples(student, path) -> path` (None: no samples), the run's own `_target_`s (what an
    end-of-run evaluation of this run folder trusts), and an image-to-video run's held-out prompts with their
    images (`(PromptEmbeddings, ImageBank)`, row i prompt i's; None: text alone)."""

    val_set: ValSet | None = None
    samples: Callable[[torch.nn.Module, Path], Path] | None = None
    targets: tuple[str, ...] = ()
    held_out_images: tuple[Any, Any] | None = None  # (PromptEmbeddings, ImageBank)


def at_least(key: str, value: int, least: int) -> int:
    """A hook setting's refusal in one line: `hooks.monitor.val_every=-1 must be 0 or more`."""
    if value < least:
        what = "0 or more" if least == 0 else f"at least {least}"
        raise UserError(f"{key}={value} must be {what}")
    return value


def sample_steps(key: str, value: int) -> int:
    """A hook's sampling steps: 1 or more and no more than a Wan scheduler's training timesteps (more only repeat
    them), refused when the hook is built, before any work, not when it first samples."""
    at_least(key, value, 1)
    if value > MAX_SAMPLE_STEPS:
        raise UserError(
            f"{key}={value} is more than a Wan scheduler's {MAX_SAMPLE_STEPS} training timesteps (more steps only "
            f"repeat them); give {MAX_SAMPLE_STEPS} or fewer (e.g. 20)"
        )
    return value


class Hook:
    main_only: ClassVar[bool] = True

    def check(self, cfg: DictConfig) -> None:
        """Before any work (the preflight): refuse, in one line, a setting the rest of the run's config makes
        impossible (`hooks.profile.after` past `trainer.max_steps`)."""

    def bind(self, ctx: RunContext, parts: HookParts) -> None:
        """Take what this hook needs from the run's context and setup's parts."""

    def __call__(self, run: Run, step: int) -> None:
        """After each step."""

    def at_end(self, run: Run) -> dict[str, Any]:
        """Once, at the end of the run (main rank): figures to add to metrics.json (none by default)."""
        return {}
