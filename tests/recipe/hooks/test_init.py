"""wandistiller/recipe/hooks/__init__.py: the hook registry against conf/hooks/, `build` (the config's order, the
main rank's hooks, the injected failure), a hook of your own in a real run, and configs saved before the list."""

from __future__ import annotations

from types import SimpleNamespace

from omegaconf import OmegaConf

from tests.conftest import CONF
from wandistiller.recipe import hooks
from wandistiller.recipe.hooks.base import Hook, HookParts
from wandistiller.recipe.hooks.fault import FaultInjection
from wandistiller.recipe.hooks.progress import ProgressLog
from wandistiller.train import run

STEPS: list[int] = []
PROGRESS = "wandistiller.recipe.hooks.progress.ProgressLog"


class CountingHook(Hook):
    """A user's hook (what hooks.<name>._target_ may name)."""

    def __init__(self, every: int = 1):
        self.every = every

    def bind(self, ctx, parts) -> None:
        self.max_steps = ctx.trainer_cfg.max_steps

    def __call__(self, run, step: int) -> None:
        if step % self.every == 0:
            STEPS.append(step)


def test_every_hook_module_has_its_yaml_and_the_default_list_is_the_five():
    assert set(hooks.REGISTRY.names()) == {p.stem for p in (CONF / "hooks").glob("*.yaml")}
    train = OmegaConf.load(CONF / "train.yaml")
    assert {"hooks": ["monitor", "progress", "samples", "evaluate", "collapse"]} in list(train.defaults)


def test_a_hook_of_your_own_runs_after_every_step_and_the_list_can_leave_one_out(make_cfg, tmp_path):
    STEPS.clear()
    cfg = make_cfg("trainer.max_steps=3", "hooks=[progress]", f"+hooks.count._target_={__name__}.CountingHook",
                   run_dir=tmp_path / "r")  # fmt: skip
    assert list(cfg.hooks) == ["progress", "count"]
    run(cfg)
    assert STEPS == [1, 2, 3]
    assert not (tmp_path / "r" / "metrics_steps.jsonl").exists()  # no monitor: nothing appended as it happened


def test_build_keeps_the_configs_order_binds_each_and_leaves_main_only_hooks_to_the_main_rank(monkeypatch):
    listed = {"count": {"_target_": f"{__name__}.CountingHook", "every": 2}, "progress": {"_target_": PROGRESS}}
    trainer = OmegaConf.create({"max_steps": 5, "log_every": 1, "progress_bar": False})
    main = hooks.build(OmegaConf.create(listed), SimpleNamespace(is_main=True, trainer_cfg=trainer), HookParts())
    assert [type(h) for h in main] == [CountingHook, ProgressLog]
    assert main[0].every == 2 and main[0].max_steps == 5 and main[1].t is trainer  # each bound to the run
    monkeypatch.setenv(FaultInjection.ENV, "1:2")  # the one hook that is not main_only: every training rank runs it
    other = hooks.build(OmegaConf.create(listed), SimpleNamespace(is_main=False, trainer_cfg=trainer), HookParts())
    assert [type(h) for h in other] == [FaultInjection]
