"""wandistiller/recipe/__init__.py: the documented `from wandistiller.recipe import DistillationRecipe`, looked up
on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

import wandistiller.recipe


def test_the_documented_base_class_is_importable_from_the_package_and_nothing_else_is():
    from wandistiller.recipe import DistillationRecipe

    assert DistillationRecipe.__module__ == "wandistiller.recipe.distillation"
    with pytest.raises(AttributeError, match="has no attribute 'NotThere'"):
        wandistiller.recipe.NotThere  # noqa: B018


@pytest.mark.slow  # a fresh interpreter importing torch: seconds for one import check
def test_importing_the_loop_does_not_build_the_whole_recipe():
    probe = "import sys, wandistiller.recipe.loop; print('wandistiller.recipe.distillation' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"
