"""`python -m wandistiller.train …`: the Hydra entrypoint, and `run(cfg)`, the plain function behind it."""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
import warnings
from pathlib import Path

import hydra
import torch.distributed as dist
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from wandistiller import plan
from wandistiller.checkpoint import checkpoint_step, list_checkpoints, resolve_resume
from wandistiller.config import register_configs
from wandistiller.data import read_prompts
from wandistiller.distributed import Topology, init_process_group, launch, under_torchrun
from wandistiller.errors import UserError, exit_on_user_error
from wandistiller.fastpaths import check_compile_mode, check_quantize
from wandistiller.precision import Precision
from wandistiller.student import check_student
from wandistiller.teacher import inspect_teacher, resolve_teacher_path
from wandistiller.worker import FAILURES, Prepared, student_device, train_worker, worker_entry

log = logging.getLogger("wandistiller")
register_configs()
# Wan keeps its norms in fp32 on purpose (diffusers' _keep_in_fp32_modules); torch warns on every call.
warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
CONF = Path(__file__).resolve().parents[1] / "conf"


@hydra.main(version_base=None, config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        run(cfg)


def run(cfg: DictConfig) -> dict:
    """Distill the configured teacher into the configured student; returns the metrics.json summary.

    Prepares once (checks, planner, teacher folder, run folder), then trains in this process, in
    workers it launches (distributed.nproc_per_node > 1, and every point of a sweep, so that no CUDA
    memory carries from one point to the next), or as one rank of a torchrun job.
    """
    topo = Topology.from_env()
    if under_torchrun():
        init_process_group(topo, cfg.distributed.timeout_min)
        box = [prepare(cfg, topo) if topo.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)  # one run folder and one resolved placement for all ranks
        return train_worker(cfg, box[0], topo)
    point = sweep_point()
    try:
        prepared = prepare(cfg, topo, point)
        if _finished(prepared, cfg):
            log.info("nothing to do: %s already reached trainer.max_steps=%d", prepared.run_dir, cfg.trainer.max_steps)
            return json.loads((Path(prepared.run_dir) / "metrics.json").read_text())
        if cfg.distributed.nproc_per_node * cfg.distributed.nnodes > 1 or point is not None:
            summary = _launch_workers(cfg, prepared)
        else:
            summary = train_worker(cfg, prepared, topo)
    except UserError as e:
        if point is None:
            raise
        return record_failed_point(cfg, e, point)  # a sweep goes on past a point that failed or was refused
    if "status" in summary:
        log.info(
            "done: %d steps at %.1f samples/s, loss %.4f -> %.4f; outputs in %s",
            summary["steps_run"],
            summary["samples_per_s_median"] or 0,
            summary["loss_first"] or 0,
            summary["loss_last"] or 0,
            prepared.run_dir,
        )
    return summary


def sweep_point() -> dict | None:
    """This job's place in a Hydra multirun: its wandb group (the sweep) and name (its overrides)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    from wandistiller.sweep import sweep_group

    hc = HydraConfig.get()
    return {
        "group": sweep_group(Path(hc.sweep.dir)),
        "name": hc.job.override_dirname or f"job{hc.job.num}",
        "overrides": list(hc.overrides.task),
        "choices": dict(hc.runtime.choices),
    }


def record_failed_point(cfg: DictConfig, error: UserError, point: dict) -> dict:
    """A failed or refused sweep point leaves a metrics.json saying so -- unless its folder holds
    another run's outputs, which are never touched."""
    print(f"error: {error}", file=sys.stderr, flush=True)
    run_dir = Path(cfg.paths.output_dir)
    record = {
        "status": "failed" if isinstance(error, WorkerFailed) else "refused",
        "reason": str(error).splitlines()[0],
        "placement": point["choices"].get("teacher_placement"),
        "precision": cfg.precision.name,
        "world_size": cfg.distributed.nproc_per_node * cfg.distributed.nnodes,
        "overrides": point["overrides"],
    }
    if "already holds another run's outputs" in record["reason"] or (run_dir / "metrics.json").exists():
        return record
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ".hydra").mkdir(exist_ok=True)
    OmegaConf.save(OmegaConf.create(point["overrides"]), run_dir / ".hydra" / "overrides.yaml")
    (run_dir / "metrics.json").write_text(json.dumps(record, indent=2))
    return record


def prepare(cfg: DictConfig, topo: Topology, point: dict | None = None) -> Prepared:
    """Everything cheap that can refuse a run, in the order that refuses earliest; then the run folder."""
    check_config(cfg)
    precision = Precision.from_config(cfg.precision)
    precision.check(student_device(topo))
    placement_cfg, table = choose_placement(cfg, precision)
    spec = inspect_teacher(resolve_teacher_path(cfg.teacher))
    check_student(cfg.student, spec.transformer_config)  # the student against the teacher, from JSON alone
    read_prompts(cfg.data.prompts_path)
    if placement_cfg is None:  # a Hub teacher: planned now that its config is here
        placement_cfg, table = choose_placement(cfg, precision)
    placement = get_class(placement_cfg["_target_"])(**{k: v for k, v in placement_cfg.items() if k != "_target_"})
    if cfg.teacher.compile and not placement.compilable:
        raise UserError(
            "teacher.compile=true works with the placements that run a whole teacher in one process (cpu, gpu, "
            "gpu0, offload, disk), not with the one chosen here; drop teacher.compile or pick one of those"
        )
    check_quantize(cfg.teacher.quantize, placement.teacher_device(topo))
    check_compile_mode(cfg.trainer.compile_mode, cfg.trainer.compile_student)
    served = placement.serving != "local" and max(cfg.distributed.nproc_per_node, topo.local_world_size) > 1
    if cfg.trainer.teacher_whole_step and served:
        raise UserError(
            f"trainer.teacher_whole_step=true batches the targets of a rank's own teacher, and with "
            f"teacher_placement={placement.name} a teacher owner serves them; use gpu, offload, disk or sharded, "
            "or drop trainer.teacher_whole_step"
        )
    run_dir = Path(cfg.paths.output_dir)
    resume_from = claim_run_dir(run_dir, cfg.trainer.resume)
    save_config(run_dir, cfg, resume_from)
    if table:
        log.info("teacher placement plan:\n%s", table)
    return Prepared(
        str(run_dir), str(spec.path), placement_cfg, str(resume_from) if resume_from else None, table, point
    )


def choose_placement(cfg: DictConfig, precision: Precision) -> tuple[dict | None, str | None]:
    """The placement config to run, `auto` resolved; a placement that cannot fit is refused, naming one that can.

    Returns (None, None) when the teacher's config is not on disk yet (a Hub id not downloaded).
    """
    placement_cfg = OmegaConf.to_container(cfg.teacher_placement, resolve=True)
    cls = get_class(placement_cfg["_target_"])
    auto = cls.__name__ == "AutoPlacement"
    if not auto:
        placement = cls(**{k: v for k, v in placement_cfg.items() if k != "_target_"})
        placement.check(precision, cfg.distributed)
    found = plan.planning_teacher_config(cfg.teacher)
    if found is None:
        return (None, None) if auto else (placement_cfg, None)
    hw = plan.Hardware.detect(cfg.hardware)
    estimates = plan.plan(plan.workload(cfg, *found, precision.teacher_dtype), hw, plan.ranks_per_node(cfg, hw))
    best = plan.choose(estimates)
    if auto:
        if best is None:
            raise UserError(
                "teacher_placement=auto: no placement fits this teacher on this hardware "
                f"({hw.describe()}); use precision=bf16, a smaller trainer.batch_size or more memory"
            )
        return _with_plan(_placement_config(best.placement), best), plan.format_table(estimates, hw, best.placement)
    name = placement.name
    mine = next((e for e in estimates if e.placement == name), None)
    if mine is not None and not mine.fits and not placement_cfg.get("debug_cpu"):
        other = f"use teacher_placement={best.placement}" if best else "no placement fits; add memory"
        raise UserError(
            f"teacher_placement={name} will not fit: it needs {_need(mine)} and this machine has "
            f"{hw.describe()}; {other} (python -m wandistiller.plan shows the table)"
        )
    return _with_plan(placement_cfg, mine), plan.format_table(estimates, hw, name)


def _with_plan(placement_cfg: dict, estimate: plan.Estimate | None) -> dict:
    """The planner decides what `auto` leaves open: how many blocks a streamed teacher keeps resident."""
    if estimate is not None and estimate.resident_blocks is not None and placement_cfg.get("resident_blocks") == "auto":
        placement_cfg["resident_blocks"] = estimate.resident_blocks
    return placement_cfg


def _placement_config(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF / "teacher_placement" / f"{name}.yaml"))


def _need(e: plan.Estimate) -> str:
    gpu = f"{max(e.gpu_bytes) / plan.GiB:.1f} GiB on its fullest GPU, " if e.gpu_bytes else ""
    return f"{gpu}{e.host_bytes / plan.GiB:.1f} GiB host RAM"


def _launch_workers(cfg: DictConfig, prepared: Prepared) -> dict:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        results = launch(worker_entry, (OmegaConf.to_container(cfg, resolve=True), prepared), cfg.distributed)
    except ChildFailedError as e:
        rank, message = _root_cause(e, Path(prepared.run_dir) / FAILURES)
        raise WorkerFailed(f"worker rank {rank} failed: {message} (its traceback is above)") from None
    return next((r for r in results if "status" in r), results[0])


# What the survivors of a crashed rank report: symptoms, not the cause.
_COLLATERAL = (
    "Connection closed by peer",
    "Connection reset",
    "remote worker",
    "Broken pipe",
    "ProcessGroup",
    "NCCL communicator was aborted",
)


def _root_cause(error, failures_dir: Path) -> tuple[int, str]:
    """The failed rank whose error is not just a broken connection to another failed rank; earliest first."""
    found = [json.loads(f.read_text()) for f in sorted(failures_dir.glob("rank*.json"))]
    shutil.rmtree(failures_dir, ignore_errors=True)
    for rank, failure in error.failures.items():  # what the launcher saw (error files written by @record)
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
        found.append(
            {
                "rank": rank,
                "time": failure.timestamp,
                "message": message.splitlines()[0] if message else f"exit code {failure.exitcode}",
            }
        )
    found.sort(key=lambda f: (any(s in f["message"] for s in _COLLATERAL), f["time"]))
    return found[0]["rank"], found[0]["message"]


class WorkerFailed(UserError):
    """A worker died (an error, an out-of-memory, a kill); its traceback was printed above."""


def check_config(cfg: DictConfig) -> None:
    """Values the schema's types cannot catch, each named with its key and a fix."""
    t, d = cfg.trainer, cfg.data
    for key, value in [
        ("trainer.batch_size", t.batch_size),
        ("trainer.grad_accum_steps", t.grad_accum_steps),
        ("trainer.max_steps", t.max_steps),
        ("trainer.checkpoint_every", t.checkpoint_every),
        ("trainer.log_every", t.log_every),
        ("data.latent_frames", d.latent_frames),
        ("data.latent_height", d.latent_height),
        ("data.latent_width", d.latent_width),
        ("distributed.nproc_per_node", cfg.distributed.nproc_per_node),
        ("distributed.nnodes", cfg.distributed.nnodes),
    ]:
        if value <= 0:
            raise UserError(f"{key}={value} must be a positive integer")
    if d.latent_height % 2 or d.latent_width % 2:
        raise UserError(
            f"data.latent_height/latent_width ({d.latent_height}x{d.latent_width}) must be even (Wan patches 2x2)"
        )
    if d.latents != "gaussian":
        raise UserError(f"data.latents={d.latents!r} is unknown; use gaussian")
    if cfg.distributed.nnodes > 1 and not cfg.distributed.rdzv_endpoint and not under_torchrun():
        raise UserError("distributed.nnodes>1 needs distributed.rdzv_endpoint=HOST:PORT of the first node")


def claim_run_dir(run_dir: Path, resume: str | None) -> Path | None:
    """Refuse to write over another run's outputs; return the checkpoint to resume from, if any."""
    finished = [p.name for p in (run_dir / "metrics.json", run_dir / "student") if p.exists()]
    earlier = list_checkpoints(run_dir)
    if (earlier or finished) and resume != "auto":
        what = f"checkpoints up to {earlier[-1].name}" if earlier else " and ".join(finished)
        raise UserError(
            f"the run folder {run_dir} already holds another run's outputs ({what}); "
            "add trainer.resume=auto to continue it, or choose a new folder with hydra.run.dir=…"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    return resolve_resume(resume, run_dir)


def _finished(prepared: Prepared, cfg: DictConfig) -> bool:
    if prepared.resume_from is None or not (Path(prepared.run_dir) / "metrics.json").is_file():
        return False
    return checkpoint_step(Path(prepared.resume_from)) >= cfg.trainer.max_steps


def save_config(run_dir: Path, cfg: DictConfig, resume_from: Path | None) -> None:
    """The composed config, as Hydra would write it; a resumed run keeps the first run's and adds its own."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(exist_ok=True)
    name = "config.yaml" if not (hydra_dir / "config.yaml").exists() else f"config_resume_{int(time.time())}.yaml"
    OmegaConf.save(cfg, hydra_dir / name)
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized() and name == "config.yaml":
        OmegaConf.save(HydraConfig.get().overrides.task, hydra_dir / "overrides.yaml")


if __name__ == "__main__":
    main()
