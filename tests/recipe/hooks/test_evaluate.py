"""wandistiller/recipe/hooks/evaluate.py: the evaluate hook's own setting and where it leaves the evaluation to
the user; the whole end-of-run evaluation runs in tests/recipe/hooks/test_monitor.py's run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from wandistiller.core.errors import UserError
from wandistiller.recipe.hooks.base import HookParts
from wandistiller.recipe.hooks.evaluate import EvaluateAtEnd


def test_its_steps_are_refused_in_one_line_below_one():
    with pytest.raises(UserError, match=r"^hooks.evaluate.steps=0 must be at least 1$"):
        EvaluateAtEnd(steps=0)
    with pytest.raises(UserError, match=r"^hooks.evaluate.limit=0 must be at least 1$"):
        EvaluateAtEnd(limit=0)
    with pytest.raises(UserError, match=r"^hooks.evaluate.per_prompt=0 must be at least 1$"):
        EvaluateAtEnd(per_prompt=0)
    hook = EvaluateAtEnd()
    assert (hook.steps, hook.per_prompt, hook.limit, hook.prompts_path) == (10, 1, 8, None)


def test_a_placement_that_spreads_the_teacher_leaves_the_evaluation_to_the_user(tmp_path, caplog):
    hook = EvaluateAtEnd(steps=2)
    placement = SimpleNamespace(whole_on_one_device=False, name="sharded")
    hook.bind(SimpleNamespace(placement=placement, run_dir=tmp_path), HookParts())
    with caplog.at_level("INFO", logger="wandistiller"):
        assert hook.at_end(SimpleNamespace()) == {}
    assert "python -m wandistiller.eval" in caplog.text and not list(tmp_path.iterdir())  # nothing evaluated
