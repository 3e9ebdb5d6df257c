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


def test_every_setting_is_checked_when_the_hook_is_built_or_bound_not_after_the_training(tmp_path):
    """Issue 41: hooks.evaluate.steps=5000, a missing prompts_path and per_prompt=1000000 were refused only after the
    whole training, naming eval's --steps, data.prompts_path and --per-prompt; now when the hook is built (before the
    run folder) or bound (before the first step), each by its own key."""
    with pytest.raises(UserError, match=r"^hooks.evaluate.steps=5000 is more than a Wan scheduler's 1000 training"):
        EvaluateAtEnd(steps=5000)
    with pytest.raises(UserError, match=r"^hooks.evaluate.prompts_path='.*nowhere.txt' does not exist; give a text"):
        EvaluateAtEnd(prompts_path=str(tmp_path / "nowhere.txt"))
    (tmp_path / "p.txt").write_text("a fox\n")
    hook = EvaluateAtEnd(per_prompt=1_000_000, prompts_path=str(tmp_path / "p.txt"))
    here = SimpleNamespace(whole_on_one_device=True, name="cpu")
    ctx = SimpleNamespace(placement=here, latent_shape=(16, 1, 8, 8), spec=SimpleNamespace(path=None), run_dir=tmp_path)
    with pytest.raises(UserError, match=r"^hooks.evaluate.per_prompt=1000000 \(x hooks.evaluate.limit=8\) asks for"):
        hook.bind(ctx, HookParts())
    EvaluateAtEnd(per_prompt=2).bind(ctx, HookParts())  # what fits is bound as before


def test_a_placement_that_spreads_the_teacher_leaves_the_evaluation_to_the_user(tmp_path, caplog):
    hook = EvaluateAtEnd(steps=2)
    placement = SimpleNamespace(whole_on_one_device=False, name="sharded")
    hook.bind(SimpleNamespace(placement=placement, run_dir=tmp_path), HookParts())
    with caplog.at_level("INFO", logger="wandistiller"):
        assert hook.at_end(SimpleNamespace()) == {}
    assert "python -m wandistiller.eval" in caplog.text and not list(tmp_path.iterdir())  # nothing evaluated
