"""wandistiller/recipe/hooks/base.py: the hook interface's defaults (what a hook that needs nothing inherits) and
the frozen parts setup hands every hook."""

from __future__ import annotations

import dataclasses

import pytest

from wandistiller.recipe.hooks.base import Hook, HookParts


class StepsOnly(Hook):
    """A hook that implements only the per-step call, as the interface allows."""

    def __init__(self):
        self.steps: list[int] = []

    def __call__(self, run, step: int) -> None:
        self.steps.append(step)


def test_a_hook_implementing_only_its_step_binds_and_ends_with_nothing_to_add():
    hook = StepsOnly()
    hook.bind(None, HookParts())
    hook(None, 1)
    first = hook.at_end(None)
    first["added"] = 1  # the caller merges it into metrics.json: a later call must not see this
    assert first == {"added": 1} and hook.at_end(None) == {}
    assert StepsOnly.main_only and Hook.main_only  # the main rank alone unless a hook says otherwise


def test_hook_parts_default_to_no_validation_no_samples_and_are_frozen():
    parts = HookParts()
    assert parts.val_set is None and parts.samples is None and parts.targets == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.samples = print
