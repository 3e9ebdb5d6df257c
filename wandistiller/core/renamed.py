"""`_target_`s that moved when the flat package became subpackages, so a saved config of an older run
(`.hydra/config.yaml`) still resumes, evaluates and exports. A loaded config is rewritten once, where it
is read back, and then compares equal to one composed today."""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig, OmegaConf

# Every `_target_` the shipped conf/ tree or a schema named before the move: old -> new.
RENAMED: dict[str, str] = {
    "wandistiller.recipe.DistillationRecipe": "wandistiller.recipe.distillation.DistillationRecipe",
    "wandistiller.loop.distillation_loss": "wandistiller.recipe.loop.distillation_loss",
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
    "evaluate": "wandistiller.eval.EvaluateAtEnd",
}


def modernize_lists(root) -> None:
    """A config saved before loggers and hooks were lists, read back as one composed today: see below."""
    modernize_loggers(root)
    if isinstance(root, DictConfig) and "trainer" in root and "hooks" not in root:
        root["hooks"] = {name: {"_target_": target} for name, target in HOOKS.items()}


def modernize_loggers(root) -> None:
    """A config saved before the list of loggers held its one logger at `logger` itself (`_target_` at the
    top): rewritten, in place, to today's `logger.wandb` (a NullTracker: no logger). A logger of the user's
    own moves to `logger.<its class name, lowercased>`, where the allow-list judges it as any other entry.
    Nothing is resolved."""
    node = root._get_node("logger") if isinstance(root, DictConfig) and "logger" in root else None
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return
    target = current_target(str(node._get_node("_target_")._value()))
    if target == RENAMED["wandistiller.tracking.NullTracker"]:
        root["logger"] = {}
        return
    saved = OmegaConf.to_container(node, resolve=False) | {"_target_": target}
    key = "wandb" if target == RENAMED["wandistiller.tracking.WandbTracker"] else target.rsplit(".", 1)[-1].lower()
    root["logger"] = {key: saved}
