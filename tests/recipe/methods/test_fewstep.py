"""wandistiller/recipe/methods/fewstep.py: what the few-step methods share lives outside any one of them, so no
option imports another (a new few-step method takes it from here); its checks and the schedule's record."""

from __future__ import annotations

import ast
import importlib
from dataclasses import fields
from pathlib import Path

import pytest

from wandistiller.core.errors import UserError
from wandistiller.recipe.methods import REGISTRY
from wandistiller.recipe.methods.fewstep import FewStepConfig, positive, schedule_identity
from wandistiller.teacher.fewstep import Schedule


def test_no_method_option_imports_another_option():
    options = {f"wandistiller.recipe.methods.{name}" for name in REGISTRY.names()}
    for module in options:
        tree = ast.parse(Path(importlib.import_module(module).__file__).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not imported & (options - {module}), module


def test_every_few_step_schema_has_the_shared_keys():
    shared = {f.name for f in fields(FewStepConfig)}
    for name in ("trajectory", "dmd"):
        schema = REGISTRY.get(name).schema
        assert issubclass(schema, FewStepConfig) and shared <= {f.name for f in fields(schema)}, name


def test_a_count_below_one_is_one_line_naming_the_key():
    assert positive("method.chunk", 3) == 3
    with pytest.raises(UserError, match=r"method.chunk=0 must be a positive integer"):
        positive("method.chunk", 0)


def test_the_default_schedule_is_recorded_as_nothing_and_another_by_its_sigmas():
    # A checkpoint from before `method.schedule` recorded no schedule: it resumes as the default.
    assert schedule_identity(Schedule()) == {}
    simple = Schedule("simple")
    assert schedule_identity(simple) == {"schedule": simple.describe()}
