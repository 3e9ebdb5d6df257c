"""`python -m wandistiller.train …`: the Hydra shell around `run(cfg)` (wandistiller/job/run.py: the plain function
that prepares and runs one job, which in-process callers use too)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from wandistiller.compose import check_overrides, register_configs
from wandistiller.core.errors import exit_on_user_error, internal_errors_reported
from wandistiller.core.hydra import check_hydra_flags, modern_argv
from wandistiller.core.stopping import how_to_continue, stop_at_once
from wandistiller.job.run import run as run_job
from wandistiller.job.rundir import note_missing_run_dir, removed_if_refused
from wandistiller.tracking.sweep import FAILED_SWEEP

# The schemas and resolvers, for Hydra's main below: registered when this module is imported because a Hydra launcher
# that runs jobs in other processes (submitit) resolves `${wd_now:}` and `${wd_rank_suffix:}` there, before the task
# function is called; importing the task function's module is the one hook such a process runs. Nothing else here
# acts on import. A bad WANDISTILLER_PLUGINS is one line here too.
with exit_on_user_error():
    register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    then = (
        f"what was saved is kept (checkpoints, finished cache chunks); to continue from its checkpoints, "
        f"{how_to_continue(cfg.paths.output_dir)}"
    )
    with internal_errors_reported(), exit_on_user_error(), removed_if_refused(Path(cfg.paths.output_dir)):
        with stop_at_once(then):  # the training steps catch it themselves, and stop after one with a checkpoint
            run(cfg)


def run(cfg: DictConfig) -> dict:
    """One training job in this process (job/run.py), its launched workers registering the options as this
    module did on import; returns the metrics.json summary."""
    return run_job(cfg, register_configs)


def cli() -> None:
    """`python -m wandistiller.train`: the overrides checked first (a typo is one line, exit code 2), then
    Hydra's main."""

    with exit_on_user_error():
        check_hydra_flags(sys.argv[1:])
        sys.argv[1:] = modern_argv(sys.argv[1:])  # Hydra reads sys.argv itself: an older key is rewritten for it too
        check_overrides(sys.argv[1:])
    note_missing_run_dir(sys.argv[1:])
    main()
    if FAILED_SWEEP:  # the sweep report said which points, and every callback of the sweep has run
        sys.exit(1)


if __name__ == "__main__":
    cli()
