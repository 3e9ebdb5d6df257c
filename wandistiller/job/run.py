"""`run(cfg)`: one training job as a plain function (what `python -m wandistiller.train`'s Hydra shell calls, and
the quality comparisons call in-process).

It prepares once (wandistiller.job.preflight: every check, the planner, the placement, the run folder), then runs
the configured recipe (`recipe._target_`) in this process, in workers it launches (distributed.nproc_per_node > 1,
and every point of a sweep, so that no CUDA memory carries from one point to the next), or as one rank of a
torchrun job.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from wandistiller.core import stopping
from wandistiller.core.distributed import (
    Topology,
    destroy_process_group,
    init_process_group,
    launch,
    under_torchrun,
    worker_logging,
)
from wandistiller.core.errors import UserError, WorkerFailed, exit_on_user_error, rate
from wandistiller.core.files import read_json_in
from wandistiller.core.stopping import launcher_stopped
from wandistiller.job.checks import check_interpolations, drop_settings_of_unlisted_hooks
from wandistiller.job.failures import FAILURES, oom_report, record_failure, root_cause
from wandistiller.job.preflight import prepare
from wandistiller.job.resumed import continued_config, task_overrides
from wandistiller.job.rundir import release_run_dir, removed_if_refused
from wandistiller.recipe.context import Prepared
from wandistiller.state.checkpoint import checkpoint_step
from wandistiller.tracking.sweep import record_failed_point, sweep_point

log = logging.getLogger("wandistiller")


def run(cfg: DictConfig, register: Callable[[], None]) -> dict:
    """Distill the configured teacher into the configured student; returns the metrics.json summary. `register`:
    the composition's `register_configs` (compose.py, above this layer), which each launched worker calls first: a
    worker process imports this module, not the caller's, and reading a run (the end-of-run evaluation) needs the
    registries."""
    check_interpolations(cfg)  # before any value is read: a bad `${…}` is one line naming its key
    drop_settings_of_unlisted_hooks(cfg)  # fresh and resumed alike: the `hooks` list decides
    topo = Topology.from_env()
    if under_torchrun():
        init_process_group(topo, cfg.distributed.timeout_min)
        box: list = [_prepare_or_refuse(cfg, topo) if topo.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)  # one run folder and one placement for all ranks
        if isinstance(box[0], UserError):
            raise box[0] if topo.rank == 0 else SystemExit(2)  # rank 0 says it once; the others just stop
        summary = run_recipe(cast(DictConfig, OmegaConf.create(box[0][1])), box[0][0], topo)
        _say_done(summary, box[0][0].run_dir)  # the main rank's summary alone has a status
        return summary
    point = sweep_point()
    try:
        cfg = continued_config(cfg, task_overrides())  # a resume continues the run's own saved config
        # In-process callers too: a refusal after the folder was claimed (a bad trainer.resume) leaves none.
        with removed_if_refused(Path(cfg.paths.output_dir)) if point is None else contextlib.nullcontext():
            prepared = prepare(cfg, topo, point)
        if _finished(prepared, cfg):
            log.info("nothing to do: %s already reached trainer.max_steps=%d", prepared.run_dir, cfg.trainer.max_steps)
            try:
                return read_json_in(Path(prepared.run_dir), "metrics.json")  # through the guard: never a link out
            except ValueError as e:  # damaged: the run is whole all the same (its student/ and checkpoints)
                log.warning("%s/metrics.json is damaged (%s); nothing was trained", prepared.run_dir, e)
                return {}
        if cfg.distributed.nproc_per_node * cfg.distributed.nnodes > 1 or point is not None:
            summary = _launch_workers(cfg, prepared, register)
        else:
            summary = run_recipe(cfg, prepared, topo)
    except UserError as e:
        if point is None:
            raise
        return record_failed_point(cfg, e, point)  # a sweep goes on past a point that failed or was refused
    finally:  # the run is over: a later run in this process or another may take its folder
        release_run_dir(Path(cfg.paths.output_dir))
    _say_done(summary, prepared.run_dir)
    return summary


def _say_done(summary: dict, run_dir: str) -> None:
    """The last line of a run, however it was started (one process, workers, torchrun, a sweep point)."""
    if "status" in summary:
        overall = summary.get("samples_per_s_overall")
        log.info(
            "done: %d steps at %s samples/s (median step)%s, loss %.4f -> %.4f; outputs in %s",
            summary["steps_run"],
            rate(summary["samples_per_s_median"]),
            f", {rate(overall)} samples/s overall ({summary['samples_this_segment']} samples in "
            f"{summary['wall_s']:.0f} s, loading and evaluation included)"
            if overall
            else "",
            summary["loss_first"] or 0,
            summary["loss_last"] or 0,
            run_dir,
        )


def _prepare_or_refuse(cfg: DictConfig, topo: Topology) -> tuple[Prepared, Any] | UserError:
    """Under torchrun: rank 0's preparation (with the resolved config), or its refusal, for every rank."""
    try:
        cfg = continued_config(cfg, task_overrides())
        prepared = prepare(cfg, topo)
        return prepared, OmegaConf.to_container(cfg, resolve=True)  # what rank 0 resolved, for every rank
    except UserError as e:
        return e


def run_recipe(cfg: DictConfig, prepared: Prepared, topo: Topology) -> dict:
    """This process's part of the run: the configured recipe's setup, then its training."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    # One progress bar (the training loop's), not one per component load; Wan keeps its norms in fp32 on purpose
    # (diffusers' _keep_in_fp32_modules), and torch warns on every call.
    diffusers_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    transformers_logging.disable_progress_bar()
    recipe = None
    try:
        init_process_group(topo, cfg.distributed.timeout_min)
        recipe = instantiate(cfg.recipe, _partial_=True)(cfg, prepared, topo)
        early = stopping.install()  # loading and compiling can take minutes: a signal exits at once
        try:
            recipe.setup()
        except UserError:
            # A resume refused before its first step (a checkpoint that does not load) leaves the run as it was:
            # its newest resume config would name what was refused, and eval and generate follow it.
            if prepared.resume_config and topo.rank == 0:
                Path(prepared.resume_config).unlink(missing_ok=True)
            raise
        finally:
            early.restore()
        return recipe.train()
    except torch.OutOfMemoryError as e:
        raise UserError(oom_report(e, prepared.plan_table)) from None
    finally:
        del recipe  # its DDP model goes while the process group still lives (see destroy_process_group)
        destroy_process_group()


@record
def worker_entry(cfg_container: dict, prepared: Prepared, register: Callable[[], None]) -> dict:
    """Entry of a worker started by the elastic launcher (`@record`: its traceback becomes the root cause)."""
    topo = Topology.from_env()
    worker_logging(topo, Path(prepared.run_dir))
    try:
        with exit_on_user_error():
            register()  # the parent registered its options; this fresh process has not
            return run_recipe(OmegaConf.create(cfg_container), prepared, topo)
    except BaseException as e:
        # The launcher reports whichever rank it saw fail first -- often a survivor whose connection to
        # the culprit broke. Each rank leaves its own error, with a time, for the parent to pick from.
        record_failure(Path(prepared.run_dir), topo.rank, e)
        raise


def _launch_workers(cfg: DictConfig, prepared: Prepared, register: Callable[[], None]) -> dict:

    d = cfg.distributed
    if d.nnodes > 1:  # the rendezvous blocks until every node has joined: say what it waits for
        log.info(
            "waiting for %d nodes at %s (rdzv_id %s); start the same command on each",
            d.nnodes,
            d.get("rdzv_endpoint"),
            d.get("rdzv_id"),
        )
    try:
        args = (OmegaConf.to_container(cfg, resolve=True), prepared, register)
        results = launch(worker_entry, args, cfg.distributed)
    except SignalException as e:  # the launcher passed the signal on; the workers stopped with a checkpoint
        shutil.rmtree(Path(prepared.run_dir) / FAILURES, ignore_errors=True)  # a stop is no failure
        raise launcher_stopped(e, prepared.run_dir) from None
    except ChildFailedError as e:
        rank, message = root_cause(e, Path(prepared.run_dir))
        raise WorkerFailed(f"worker rank {rank} failed: {message} (its traceback is above)") from None
    return next((r for r in results if "status" in r), results[0])


def _finished(prepared: Prepared, cfg: DictConfig) -> bool:
    """Whether a resume has nothing to do: its checkpoint at trainer.max_steps and the run's final outputs written
    (without its student/, lost or moved, it writes them again from that checkpoint, as export's line says)."""
    run_dir = Path(prepared.run_dir)
    if prepared.resume_from is None or not (run_dir / "metrics.json").is_file() or not (run_dir / "student").is_dir():
        return False
    return checkpoint_step(Path(prepared.resume_from)) >= cfg.trainer.max_steps
