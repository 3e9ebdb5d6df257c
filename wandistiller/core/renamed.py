"""`_target_`s and keys that moved (the flat package becoming subpackages, a loss's keys moving into the loss), so a
saved config of an older run (`.hydra/config.yaml`) still resumes, evaluates and exports, and an older command
line still runs. A loaded config is rewritten once, where it is read back, and then compares equal to one
composed today; an older override is rewritten, with a warning, before Hydra reads it.

Compatibility with this project's own pre-release runs (docs/ARCHITECTURE.md, "Compatibility"): removed in 0.2."""

from __future__ import annotations

from typing import Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf

from wandistiller.core.errors import UserError

# Every `_target_` the shipped conf/ tree or a schema named before the move: old -> new.
RENAMED: dict[str, str] = {
    "wandistiller.recipe.DistillationRecipe": "wandistiller.recipe.distillation.DistillationRecipe",
    # The old-shape distillation function is gone: its node's keys (hidden_kd_weight) are the class's.
    "wandistiller.loop.distillation_loss": "wandistiller.recipe.losses.distillation.Distillation",
    "wandistiller.recipe.loop.distillation_loss": "wandistiller.recipe.losses.distillation.Distillation",
    "wandistiller.eval.EvaluateAtEnd": "wandistiller.recipe.hooks.evaluate.EvaluateAtEnd",
    "wandistiller.student.build_student": "wandistiller.student.model.build_student",
    "wandistiller.tracking.WandbTracker": "wandistiller.tracking.loggers.wandb.WandbTracker",
    "wandistiller.tracking.NullTracker": "wandistiller.tracking.loggers.base.NullTracker",
    "wandistiller.tracking.loggers.WandbTracker": "wandistiller.tracking.loggers.wandb.WandbTracker",
    "wandistiller.tracking.loggers.NullTracker": "wandistiller.tracking.loggers.base.NullTracker",
    "wandistiller.sweep.SweepReport": "wandistiller.tracking.sweep.SweepReport",
    "wandistiller.sweep.LauncherCheck": "wandistiller.tracking.sweep.LauncherCheck",
    "wandistiller.rundir.RunDirCheck": "wandistiller.job.rundir.RunDirCheck",
    "wandistiller.losses.Distillation": "wandistiller.recipe.losses.distillation.Distillation",
    "wandistiller.losses.Task": "wandistiller.recipe.losses.task.Task",
    "wandistiller.losses.Blend": "wandistiller.recipe.losses.blend.Blend",
    # recipe/losses.py became the package recipe/losses/, a module per loss (the old paths still import).
    "wandistiller.recipe.losses.Distillation": "wandistiller.recipe.losses.distillation.Distillation",
    "wandistiller.recipe.losses.Task": "wandistiller.recipe.losses.task.Task",
    "wandistiller.recipe.losses.Blend": "wandistiller.recipe.losses.blend.Blend",
}


# Keys that moved: old -> new. Their values move with them (a saved config, a command-line override).
MOVED_KEYS: dict[str, str] = {
    "student.hidden_kd_weight": "trainer.loss.hidden_kd_weight",
    # The shipped hooks' settings, once trainer keys; the end-of-run evaluation sampled with trainer.sample_steps.
    "trainer.val_every": "hooks.monitor.val_every",
    "trainer.sample_every": "hooks.samples.every",
    "trainer.sample_prompts": "hooks.samples.prompts",
    "trainer.sample_steps": "hooks.samples.steps hooks.evaluate.steps",
    # trainer.eval_at_end=false: the evaluate hook left out of the list (true: it is in the default list).
    "trainer.eval_at_end": "hooks.evaluate",
}
EVALUATE_SWITCH = "trainer.eval_at_end"


def current_target(name: str) -> str:
    """Today's path of a `_target_` (itself when it never moved)."""
    return RENAMED.get(name, name)


def modernize(node) -> None:
    """Rewrite, in place, every moved `_target_` in a loaded config (nested nodes and lists included)."""
    if isinstance(node, DictConfig):
        for key in list(node.keys()):
            child = node._get_node(key)  # never resolved: a received config's interpolations stay unread
            if key == "_target_":
                raw = child._value() if child is not None else None
                if isinstance(raw, str) and raw in RENAMED:
                    node[key] = RENAMED[raw]
            else:
                modernize(child)
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            modernize(node._get_node(i))


# The hooks every run had before they were a list in the config (`hooks=[monitor,progress,samples,evaluate]`).
HOOKS = {
    "monitor": "wandistiller.recipe.hooks.monitor.Monitor",
    "progress": "wandistiller.recipe.hooks.progress.ProgressLog",
    "samples": "wandistiller.recipe.hooks.samples.SampleGrids",
    "evaluate": "wandistiller.recipe.hooks.evaluate.EvaluateAtEnd",
}


def modernize_lists(root) -> None:
    """A config saved before loggers and hooks were lists, or before keys moved, read back as one composed today."""
    modernize_loggers(root)
    if isinstance(root, DictConfig) and "trainer" in root and "hooks" not in root:
        root["hooks"] = {name: {"_target_": target} for name, target in HOOKS.items()}
    modernize_keys(root)


def modernize_loggers(root) -> None:
    """A config saved before the list of loggers held its one logger at `logger` itself (`_target_` at the
    top): rewritten, in place, to today's `logger.wandb` (a NullTracker: no logger). A logger of the user's
    own moves to `logger.<its class name, lowercased>`, where the allow-list judges it as any other entry.
    Nothing is resolved."""
    node = root._get_node("logger") if isinstance(root, DictConfig) and "logger" in root else None
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return
    target = current_target(str(_raw(node, "_target_")))
    if target == RENAMED["wandistiller.tracking.NullTracker"]:
        root["logger"] = {}
        return
    saved = cast(dict, OmegaConf.to_container(node, resolve=False)) | {"_target_": target}
    key = "wandb" if target == RENAMED["wandistiller.tracking.WandbTracker"] else target.rsplit(".", 1)[-1].lower()
    root["logger"] = {key: saved}


def modernize_keys(root) -> None:
    """A saved config's moved keys (MOVED_KEYS), in place and unresolved: each value goes to its new place(s) where
    that node is in the config (a hook left out of the list takes none), `trainer.eval_at_end: false` leaves the
    evaluate hook out. The old loss nodes read `hidden_kd_weight: ${student.hidden_kd_weight}`: they get its
    value, and a loss that no longer takes the key (a task loss, which discarded it) loses it."""
    if not isinstance(root, DictConfig):
        return
    for old, new in MOVED_KEYS.items():
        parent_key, key = old.rsplit(".", 1)
        parent = root._get_node(parent_key) if parent_key in root else None
        if not isinstance(parent, DictConfig) or key not in parent:
            continue
        value = _raw(parent, key)
        del parent[key]
        if old == EVALUATE_SWITCH:
            hooks = root._get_node("hooks") if "hooks" in root else None
            if value is False and isinstance(hooks, DictConfig) and "evaluate" in hooks:
                del hooks["evaluate"]
            continue
        for place in new.split():
            _put(root, old, place, value)


def _raw(parent: DictConfig, key: str) -> Any:
    """`parent.key` as saved, unresolved (an interpolation stays its string); the caller has seen the key."""
    node = parent._get_node(key)
    assert node is not None
    return node._value()


def _put(root: DictConfig, old: str, place: str, value) -> None:
    parent_key, key = place.rsplit(".", 1)
    target = OmegaConf.select(root, parent_key, default=None, throw_on_resolution_failure=False)
    if not isinstance(target, DictConfig):
        return  # that hook (or loss) is not in this config: the setting had no effect
    if parent_key != "trainer.loss":
        target[key] = value
    elif key in target and _raw(target, key) == "${" + old + "}":
        if current_target(str(_raw(target, "_target_"))) == _TASK:
            del target[key]
        else:
            target[key] = value


_TASK = "wandistiller.recipe.losses.task.Task"


def modern_override(override: str) -> tuple[list[str], str | None]:
    """(today's overrides, a warning or None) for one command-line override of an older key."""
    prefix = override[: len(override) - len(override.lstrip("+~"))]
    key, eq, value = override[len(prefix) :].partition("=")
    if key not in MOVED_KEYS:
        return [override], None
    places = MOVED_KEYS[key].split()
    if "," in value and not value.lstrip().startswith("[") and (key == EVALUATE_SWITCH or len(places) > 1):
        instead = (
            "hooks=[monitor,progress,samples],[monitor,progress,samples,evaluate]"
            if key == EVALUATE_SWITCH
            else f"{places[0]}={value}, with {' and '.join(places[1:])} set once"
        )
        raise UserError(
            f"{key}={value}: a sweep of a key that is now {' and '.join(places)} cannot be rewritten "
            f"as one; sweep the new keys, e.g. {instead}"
        )
    if key == EVALUATE_SWITCH:
        new = ["~hooks.evaluate"] if value.strip().lower() == "false" else []
        now = "the evaluate hook in `hooks` (in the default list; ~hooks.evaluate leaves it out)"
        return new, f"{key} is now {now}: ran as {' '.join(new) or 'the default'}; write it so from now on"
    new = [f"{prefix}{place}{eq}{value}" for place in MOVED_KEYS[key].split()]
    return new, f"{key} is now {' and '.join(MOVED_KEYS[key].split())}: ran as {' '.join(new)}; write it so from now on"
