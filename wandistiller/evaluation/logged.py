"""An evaluation's numbers added to the run's own loggers (csv, tensorboard, wandb, ...), at the step of the student
evaluated: each logger reopened as its class says (`Logger.reopened`), so nothing here names one. An evaluation at
the run's own settings is `eval/<figure>` (one curve over the checkpoints evaluated); one at other settings is
keyed by them as its file is (`eval_student1/<figure>`), so no curve mixes two settings."""

from __future__ import annotations

from pathlib import Path

from hydra.utils import get_class
from omegaconf import OmegaConf

from wandistiller.core.errors import UserError
from wandistiller.core.files import in_run
from wandistiller.core.renamed import current_target
from wandistiller.state.checkpoint import STATE_FILE, checkpoint_step, list_checkpoints
from wandistiller.state.received import load_json, load_received
from wandistiller.state.trust import Trust
from wandistiller.tracking import loggers


def log_to_run(run_dir: Path, result: dict, trust: Trust | None = None) -> None:
    """Add the evaluation to every logger the run was saved with (csv, tensorboard, wandb, ...), in the run folder.
    wandb continues the run's own run (its id is in the run's checkpoints; none: wandb is skipped), offline,
    whatever the saved config says, unless `--wandb-mode online` is given here."""

    trust = trust or Trust()
    nodes, run_id = _reopened(run_dir, trust)
    if not nodes:
        return
    tracker = loggers.build(OmegaConf.create(nodes))
    tracker.start(run_dir, {}, run_id)  # start_step None: a finished run's rows are kept
    try:
        step = evaluated_step(run_dir, Path(result["student"]))
        key = "_".join(["eval", *result.get("variant", [])])
        metrics = {f"{key}/{k}": v for k, v in result["mean"].items()}
        tracker.log(metrics, step=step)  # a logger that cannot take an earlier step says so itself (wandb)
        tracker.log_image(key, run_dir / result["files"][1], step=step)
        if len(result["files"]) > 2:  # a clip run's animation beside its still strip
            tracker.log_video(f"{key}_clips", run_dir / result["files"][2], step=step)
        # The summary's eval_* (metrics.json's) only from the result they quote: eval.json, the final student at the
        # run's own settings; a checkpoint's or another setting's figures are their own rows, not its summary.
        own = result["files"][0] == "eval.json"
        tracker.finish({f"eval_{k}": v for k, v in result["mean"].items()} if own else {})
    finally:
        tracker.close()
    if tracker.run_id:
        print(f"logged to the run's wandb run {tracker.run_id}")
    print(f"logged to the run's loggers: {', '.join(nodes)}")


def _reopened(run_dir: Path, trust: Trust) -> tuple[dict, str | None]:
    """({key: logger node as reopened here}, the run's tracker id): each logger of the run's saved config as its
    class reopens it in a later process (`reopened`), none that would start a stray run."""
    checkpoints = list_checkpoints(run_dir)
    saved = load_received(in_run(run_dir, ".hydra/config.yaml"), trust.targets, root=run_dir)  # its `_target_`s vetted
    run_id = load_json(checkpoints[-1] / STATE_FILE, root=run_dir).get("tracker_run_id") if checkpoints else None
    nodes = {}
    for key, node in loggers.entries(saved.logger):  # each logger says how a later process reopens it
        reopened = getattr(get_class(current_target(str(node._target_))), "reopened", None)
        node = reopened(node, run_id, trust.wandb_mode) if reopened else node
        if node is not None:  # None: it would start a stray run (wandb without the run's id)
            nodes[key] = node
    return nodes, run_id


def login_problem(run_dir: Path, trust: Trust) -> str | None:
    """Why a logger the evaluation would reopen cannot log in (its class's `login_problem`: online without a key),
    asked before anything samples, of a run folder (state/runs.run_config_file); None where each can, or none is
    reopened."""
    for node in _reopened(Path(run_dir), trust)[0].values():
        ask = getattr(get_class(current_target(str(node._target_))), "login_problem", None)
        problem = ask(node.get("mode")) if callable(ask) else None
        if problem:
            return problem
    return None


def evaluated_step(run_dir: Path, student: Path) -> int | None:
    """The training step of the student evaluated, where its numbers belong in the run's charts: a checkpoint's
    own step; for the final student the run's last step (metrics.json's final_step, written with it; else the
    latest checkpoint's, as the last step is always checkpointed). None where neither can be read."""

    if student.name != "student":
        step = checkpoint_step(student)
        return step if step >= 0 else None
    try:
        final = load_json(in_run(run_dir, "metrics.json"), root=run_dir).get("final_step")
    except (OSError, ValueError, AttributeError, UserError):
        final = None
    if isinstance(final, int) and not isinstance(final, bool):
        return final
    checkpoints = list_checkpoints(run_dir)
    step = checkpoint_step(checkpoints[-1]) if checkpoints else -1
    return step if step >= 0 else None
