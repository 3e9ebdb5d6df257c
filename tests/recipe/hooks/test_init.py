"""Loop hooks as a list from config (`hooks=[monitor,progress,samples]`): each shipped option is a module with
its schema, a hook of your own runs after every step, the injected failure of the failure-handling tests is a
hook outside the loop, and configs saved before the list run the same hooks."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.conftest import CONF
from wandistiller.recipe import hooks
from wandistiller.recipe.hooks.base import Hook
from wandistiller.train import run

STEPS: list[int] = []


class CountingHook(Hook):
    """A user's hook (what hooks.<name>._target_ may name)."""

    def __init__(self, every: int = 1):
        self.every = every

    def bind(self, ctx, parts) -> None:
        self.max_steps = ctx.trainer_cfg.max_steps

    def __call__(self, run, step: int) -> None:
        if step % self.every == 0:
            STEPS.append(step)


def test_every_hook_module_has_its_yaml_and_the_default_list_is_the_three():
    assert set(hooks.options()) - {"fault"} == {p.stem for p in (CONF / "hooks").glob("*.yaml")}
    train = OmegaConf.load(CONF / "train.yaml")
    assert {"hooks": ["monitor", "progress", "samples", "evaluate"]} in list(train.defaults)


def test_a_hook_of_your_own_runs_after_every_step_and_the_list_can_leave_one_out(make_cfg, tmp_path):
    STEPS.clear()
    cfg = make_cfg("trainer.max_steps=3", "hooks=[progress]", f"+hooks.count._target_={__name__}.CountingHook",
                   run_dir=tmp_path / "r")  # fmt: skip
    assert list(cfg.hooks) == ["progress", "count"]
    run(cfg)
    assert STEPS == [1, 2, 3]
    assert not (tmp_path / "r" / "metrics_steps.jsonl").exists()  # no monitor: nothing appended as it happened


def test_the_injected_failure_is_a_hook_that_fails_its_step_on_its_rank(make_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDISTILLER_INJECT_FAILURE", "0:2")
    with pytest.raises(RuntimeError, match="injected failure at step 2"):
        run(make_cfg("trainer.max_steps=4", run_dir=tmp_path / "r"))
    monkeypatch.setenv("WANDISTILLER_INJECT_FAILURE", "1:2")  # another rank's: this one runs to the end
    assert run(make_cfg("trainer.max_steps=3", run_dir=tmp_path / "s"))["steps_run"] == 3


def test_a_config_saved_before_the_list_runs_the_same_three_hooks():
    from wandistiller.core.renamed import HOOKS, modernize_lists

    saved = OmegaConf.create({"trainer": {"max_steps": 1}})
    modernize_lists(saved)
    assert {k: v["_target_"] for k, v in saved.hooks.items()} == HOOKS
    from hydra.utils import get_object

    for target in HOOKS.values():
        assert issubclass(get_object(target), Hook)
