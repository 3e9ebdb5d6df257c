"""`_target_`s that moved when the flat package became subpackages, so a saved config of an older run
(`.hydra/config.yaml`) still resumes, evaluates and exports. A loaded config is rewritten once, where it
is read back, and then compares equal to one composed today."""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig

# Every `_target_` the shipped conf/ tree or a schema named before the move: old -> new.
RENAMED: dict[str, str] = {
    "wandistiller.recipe.DistillationRecipe": "wandistiller.recipe.distillation.DistillationRecipe",
    "wandistiller.loop.distillation_loss": "wandistiller.recipe.loop.distillation_loss",
    "wandistiller.student.build_student": "wandistiller.student.model.build_student",
    "wandistiller.tracking.WandbTracker": "wandistiller.tracking.loggers.WandbTracker",
    "wandistiller.tracking.NullTracker": "wandistiller.tracking.loggers.NullTracker",
    "wandistiller.sweep.SweepReport": "wandistiller.tracking.sweep.SweepReport",
    "wandistiller.sweep.LauncherCheck": "wandistiller.tracking.sweep.LauncherCheck",
    "wandistiller.rundir.RunDirCheck": "wandistiller.job.rundir.RunDirCheck",
    "wandistiller.losses.Distillation": "wandistiller.recipe.losses.Distillation",
    "wandistiller.losses.Task": "wandistiller.recipe.losses.Task",
    "wandistiller.losses.Blend": "wandistiller.recipe.losses.Blend",
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
