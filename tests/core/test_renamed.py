"""`wandistiller.core.renamed`: an older run's saved config read back as one composed today (moved `_target_`s, its
one logger, its implicit hooks), rewritten in place without resolving anything; called on tiny OmegaConf trees."""

from __future__ import annotations

import importlib

from omegaconf import OmegaConf

from wandistiller.core.renamed import HOOKS, RENAMED, current_target, modernize, modernize_lists, modernize_loggers
from wandistiller.recipe.hooks.base import Hook


def test_a_moved_target_gets_todays_path_and_any_other_keeps_its_own():
    assert current_target("wandistiller.losses.Task") == "wandistiller.recipe.losses.task.Task"
    assert current_target("mypkg.hooks.MyHook") == "mypkg.hooks.MyHook"
    assert all(current_target(new) == new for new in RENAMED.values())  # today's paths never move again


def test_targets_are_rewritten_in_nested_nodes_and_lists_and_nothing_is_resolved():
    saved = OmegaConf.create({
        "recipe": {"_target_": "wandistiller.recipe.DistillationRecipe"},
        "trainer": {"loss": {"_target_": "wandistiller.losses.Blend", "weight": "${oc.env:NOT_SET_ANYWHERE}"}},
        "hooks": [{"_target_": "wandistiller.sweep.SweepReport"}, {"_target_": "mypkg.Mine"}, 3],
        "student": {"_target_": "${oc.env:NOT_SET_ANYWHERE}"},  # an interpolation: left as written, unread
    })  # fmt: skip
    modernize(saved)
    assert saved.recipe._target_ == "wandistiller.recipe.distillation.DistillationRecipe"
    assert saved.trainer.loss._target_ == "wandistiller.recipe.losses.blend.Blend"
    assert [h._target_ for h in saved.hooks[:2]] == ["wandistiller.tracking.sweep.SweepReport", "mypkg.Mine"]
    raw = OmegaConf.to_container(saved, resolve=False)
    assert raw["student"]["_target_"] == raw["trainer"]["loss"]["weight"] == "${oc.env:NOT_SET_ANYWHERE}"


def test_an_old_single_logger_moves_under_its_name_and_a_null_tracker_becomes_no_logger():
    wandb = OmegaConf.create({"logger": {"_target_": "wandistiller.tracking.WandbTracker", "project": "p"}})
    modernize_loggers(wandb)
    assert OmegaConf.to_container(wandb.logger) == {
        "wandb": {"_target_": "wandistiller.tracking.loggers.wandb.WandbTracker", "project": "p"}
    }
    none = OmegaConf.create({"logger": {"_target_": "wandistiller.tracking.NullTracker"}})
    modernize_loggers(none)
    assert OmegaConf.to_container(none.logger) == {}
    own = OmegaConf.create({"logger": {"_target_": "mypkg.loggers.MyLogger", "file": "${run_name}"}})
    modernize_loggers(own)  # the user's own logger: keyed by its class name, where the allow-list judges it
    assert OmegaConf.to_container(own.logger, resolve=False) == {
        "mylogger": {"_target_": "mypkg.loggers.MyLogger", "file": "${run_name}"}
    }
    today = OmegaConf.create({"logger": {"csv": {"_target_": "wandistiller.tracking.loggers.csv.CsvLogger"}}})
    modernize_loggers(today)  # already a list of loggers: untouched
    assert list(today.logger) == ["csv"]


def test_a_config_from_before_the_hooks_list_gets_the_four_hooks_every_run_had_then():
    old = OmegaConf.create({"trainer": {"max_steps": 2}, "logger": {"_target_": "wandistiller.tracking.NullTracker"}})
    modernize_lists(old)
    assert {name: node._target_ for name, node in old.hooks.items()} == HOOKS and old.logger == {}
    for target in HOOKS.values():  # each still a class a config can instantiate
        module, name = target.rsplit(".", 1)
        assert isinstance(getattr(importlib.import_module(module), name), type), target
    mine = OmegaConf.create({"trainer": {"max_steps": 2}, "hooks": {"monitor": {"_target_": HOOKS["monitor"]}}})
    modernize_lists(mine)  # a list of its own is kept as it is
    assert list(mine.hooks) == ["monitor"]


def test_a_config_saved_before_the_list_runs_the_same_three_hooks():
    from wandistiller.core.renamed import HOOKS, modernize_lists

    saved = OmegaConf.create({"trainer": {"max_steps": 1}})
    modernize_lists(saved)
    assert {k: v["_target_"] for k, v in saved.hooks.items()} == HOOKS
    from hydra.utils import get_object

    for target in HOOKS.values():
        assert issubclass(get_object(target), Hook)


def test_a_config_saved_with_the_one_flat_logger_reads_back_as_the_list():
    saved = OmegaConf.create({"logger": {"_target_": "wandistiller.tracking.WandbTracker", "project": "p"}})
    modernize(saved)
    modernize_loggers(saved)
    assert saved.logger.wandb._target_ == "wandistiller.tracking.loggers.wandb.WandbTracker"
    assert saved.logger.wandb.project == "p"
    none = OmegaConf.create({"logger": {"_target_": "wandistiller.tracking.loggers.NullTracker"}})
    modernize_loggers(none)
    assert OmegaConf.to_container(none.logger) == {}
    mine = OmegaConf.create({"logger": {"_target_": "my_pkg.logs.MyLogger", "level": 2}})
    modernize_loggers(mine)  # a flat logger of the user's own: moved under its name, not left flat to be refused
    assert OmegaConf.to_container(mine.logger) == {"mylogger": {"_target_": "my_pkg.logs.MyLogger", "level": 2}}
    hostile = OmegaConf.create({"logger": {"_target_": "pathlib.Path.write_text"}})
    modernize_loggers(hostile)
    assert hostile.logger.write_text._target_ == "pathlib.Path.write_text"  # for the allow-list to refuse


def test_a_moved_key_takes_its_value_to_the_loss_and_a_loss_that_no_longer_takes_it_drops_it():
    from wandistiller.core.renamed import modernize_keys

    saved = OmegaConf.create({
        "student": {"builder": "tiny", "hidden_kd_weight": 0.3},
        "trainer": {"loss": {"_target_": "wandistiller.loop.distillation_loss", "_partial_": True,
                             "hidden_kd_weight": "${student.hidden_kd_weight}"}},
    })  # fmt: skip
    modernize(saved)
    modernize_keys(saved)
    assert "hidden_kd_weight" not in saved.student
    assert saved.trainer.loss == {"_target_": "wandistiller.recipe.losses.distillation.Distillation",
                                  "_partial_": True, "hidden_kd_weight": 0.3}  # fmt: skip
    task = OmegaConf.create(
        {
            "student": {"hidden_kd_weight": 0.0},
            "trainer": {
                "loss": {
                    "_target_": "wandistiller.recipe.losses.task.Task",
                    "hidden_kd_weight": "${student.hidden_kd_weight}",
                }
            },
        }
    )
    modernize_keys(task)
    assert (
        task.trainer.loss == {"_target_": "wandistiller.recipe.losses.task.Task"}
        and "hidden_kd_weight" not in task.student
    )


def test_an_older_override_runs_as_todays_and_says_so():
    from wandistiller.core.renamed import modern_override

    assert modern_override("student.hidden_kd_weight=0.5") == (
        ["trainer.loss.hidden_kd_weight=0.5"],
        "student.hidden_kd_weight is now trainer.loss.hidden_kd_weight: ran as trainer.loss.hidden_kd_weight=0.5; "
        "write it so from now on",
    )
    assert modern_override("trainer.max_steps=5") == (["trainer.max_steps=5"], None)
    assert modern_override("trainer.sample_steps=2")[0] == ["hooks.samples.steps=2", "hooks.evaluate.steps=2"]
    assert modern_override("trainer.eval_at_end=false")[0] == ["~hooks.evaluate"]
    assert modern_override("trainer.eval_at_end=true")[0] == []


def test_an_old_trainers_hook_settings_move_to_the_hooks_that_are_in_its_list():
    saved = OmegaConf.create({"trainer": {"val_every": 25, "sample_every": 0, "sample_prompts": 2, "sample_steps": 3,
                                          "eval_at_end": False, "max_steps": 9}})  # fmt: skip
    modernize_lists(saved)  # saved before the hooks list: every shipped hook, then their settings
    assert saved.trainer == {"max_steps": 9}
    assert saved.hooks.monitor.val_every == 25 and saved.hooks.samples == {
        "_target_": HOOKS["samples"], "every": 0, "prompts": 2, "steps": 3}  # fmt: skip
    assert "evaluate" not in saved.hooks  # eval_at_end: false
    kept = OmegaConf.create(
        {"trainer": {"val_every": 5, "eval_at_end": True}, "hooks": {"progress": {"_target_": "x"}}}
    )
    modernize_lists(kept)  # hooks of its own list: a setting of a hook not in it had no effect
    assert kept.trainer == {} and kept.hooks == {"progress": {"_target_": "x"}}
