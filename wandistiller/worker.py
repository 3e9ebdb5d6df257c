"""One training process: its role, its teacher (if it holds one), its student, the loop, the outputs."""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from wandistiller.checkpoint import checkpoint_step, load_checkpoint
from wandistiller.data import batch_source, encode_prompts, read_prompts
from wandistiller.distributed import Topology, destroy_process_group, init_process_group
from wandistiller.errors import UserError, exit_on_user_error
from wandistiller.fastpaths import compile_kwargs, quantize_teacher, use_attention_backend
from wandistiller.loop import Run, memory_metrics, train_loop
from wandistiller.precision import Precision
from wandistiller.student import build_student, init_from_teacher
from wandistiller.targets import LocalTargets, OwnerTargets, RemoteTargets, Served, WholeStepTargets, serve
from wandistiller.teacher import compile_blocks, inspect_teacher
from wandistiller.tracking import NullTracker

log = logging.getLogger("wandistiller")


@dataclass(frozen=True)
class Prepared:
    """What the Hydra job settled before any worker starts (picklable: it travels to spawned workers)."""

    run_dir: str
    teacher_path: str
    placement: dict  # the teacher_placement config, `auto` already resolved
    resume_from: str | None
    plan_table: str | None
    sweep_point: dict | None = None  # group, name, overrides, choices: when this run is one point of a sweep


@dataclass(frozen=True)
class Roles:
    """Who does what, from the placement's serving mode and the process layout."""

    trains: bool
    has_teacher: bool
    owner: int | None  # the rank serving this rank's targets; None when it computes its own
    served: tuple[Served, ...]  # ranks this rank serves (owners only)
    students: tuple[int, ...]  # every training rank (the DDP group)
    dp_rank: int  # index among the students; -1 for a dedicated owner

    @property
    def main(self) -> int:
        """The first training rank writes checkpoints, outputs and the tracker."""
        return self.students[0]


def roles_for(serving: str, topo: Topology) -> Roles:
    everyone = tuple(range(topo.world_size))
    owner = topo.node_ranks[0]
    if serving == "local":
        return Roles(True, True, None, (), everyone, topo.rank)
    students = everyone if serving == "node_owner" else tuple(r for r in everyone if r % topo.local_world_size)
    if not students:
        raise RuntimeError("no training rank: a dedicated teacher owner needs more than one process per node")
    served = tuple(Served(r, students.index(r)) for r in topo.node_ranks if r != owner)
    is_owner = topo.rank == owner
    return Roles(
        trains=topo.rank in students,
        has_teacher=is_owner,
        owner=None if is_owner else owner,
        served=served if is_owner else (),
        students=students,
        dp_rank=students.index(topo.rank) if topo.rank in students else -1,
    )


def student_device(topo: Topology) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", topo.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


FAILURES = ".failures"


@record
def worker_entry(cfg_container: dict, prepared: Prepared) -> dict:
    """Entry of a worker started by the elastic launcher (`@record`: its traceback becomes the root cause)."""
    topo = Topology.from_env()
    _setup_logging(topo, Path(prepared.run_dir))
    try:
        with exit_on_user_error():
            return train_worker(OmegaConf.create(cfg_container), prepared, topo)
    except BaseException as e:
        # The launcher reports whichever rank it saw fail first -- often a survivor whose connection to
        # the culprit broke. Each rank leaves its own error, with a time, for the parent to pick from.
        folder = Path(prepared.run_dir) / FAILURES
        folder.mkdir(exist_ok=True)
        cause = e.__context__ if isinstance(e, SystemExit) and e.__context__ else e
        first_line = str(cause).splitlines()[0] if str(cause) else ""
        message = first_line if isinstance(cause, UserError) else f"{type(cause).__name__}: {first_line}"
        (folder / f"rank{topo.rank}.json").write_text(
            json.dumps({"rank": topo.rank, "time": time.time(), "message": message})
        )
        raise


def train_worker(cfg: DictConfig, prepared: Prepared, topo: Topology) -> dict:
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    # One progress bar (the training loop's), not one per component load.
    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    try:
        init_process_group(topo, cfg.distributed.timeout_min)
        return _train(cfg, prepared, topo)
    except torch.OutOfMemoryError as e:
        raise UserError(oom_report(e, prepared)) from None
    finally:
        destroy_process_group()


def _train(cfg: DictConfig, prepared: Prepared, topo: Topology) -> dict:
    return Worker(cfg, prepared, topo).run()


class Worker:
    """One process's view of the run: who it is, where it computes, what it trains."""

    def __init__(self, cfg: DictConfig, prepared: Prepared, topo: Topology):
        self.cfg, self.prepared, self.topo = cfg, prepared, topo
        self.run_dir = Path(prepared.run_dir)
        self.placement = instantiate(prepared.placement)
        self.roles = roles_for(self.placement.serving, topo)
        self.device = student_device(topo) if self.roles.trains else self.placement.teacher_device(topo)
        self.precision = Precision.from_config(cfg.precision)
        self.spec = inspect_teacher(Path(prepared.teacher_path))
        self.is_main = topo.rank == self.roles.main

    def run(self) -> dict:
        started = time.time()
        cfg, topo, roles = self.cfg, self.topo, self.roles
        embeddings = self.embeddings()
        teacher = self.placement.load(self.spec, cfg.teacher, self.precision, topo) if roles.has_teacher else None
        if teacher is not None:  # the opt-in fast paths, before compiling (a graph then sees fp8 layers)
            quantize_teacher(teacher, cfg.teacher.quantize)
            use_attention_backend(teacher, cfg.teacher.attention_backend)
        if teacher is not None and cfg.teacher.compile and getattr(self.placement, "compilable", False):
            for expert in teacher.experts:
                compile_blocks(expert)
        shape = (
            self.spec.transformer_config["in_channels"],
            cfg.data.latent_frames,
            cfg.data.latent_height,
            cfg.data.latent_width,
        )
        batch_fn = batch_source(
            cfg.seed,
            cfg.trainer.batch_size,
            shape,
            cfg.teacher.flow_shift or self.spec.flow_shift,
            self.spec.num_train_timesteps,
            embeddings,
            self.device,  # built where they are used; the same values as on the CPU
        )
        resume_from = Path(self.prepared.resume_from) if self.prepared.resume_from else None
        start_step = checkpoint_step(resume_from) if resume_from else 0
        # Only training ranks need the optimizer and student states; a dedicated owner needs the step alone.
        state = load_checkpoint(resume_from) if resume_from and roles.trains else None
        student_group = dist.new_group(list(roles.students)) if topo.distributed else None

        if roles.trains:
            run = self.build_run(teacher, batch_fn, student_group, state)
            history = train_loop(run, cfg.trainer, cfg.student.hidden_kd_weight, start_step)
            role = "owner + student" if roles.has_teacher and roles.served else "student"
            rank_summary = {"rank": topo.rank, "role": role} | memory_metrics()
        else:  # a dedicated owner: serve until the students are done
            log.info(
                "rank %d: teacher owner on %s serving ranks %s",
                topo.rank,
                teacher.device,
                [s.rank for s in roles.served],
            )
            stats = serve(
                teacher,
                list(roles.served),
                batch_fn,
                range(start_step, cfg.trainer.max_steps),
                cfg.trainer.grad_accum_steps,
                cfg.student.hidden_kd_weight > 0,
                self.transfer_device(),
            )
            rank_summary = {"rank": topo.rank, "role": "teacher owner"} | stats | memory_metrics()
            history, run = [], None

        ranks = _gather(topo, rank_summary)
        grid = self.save_outputs(teacher, run, embeddings)
        if not self.is_main:
            return rank_summary
        summary = self.summarize(history, run.student, ranks, time.time() - started)
        (self.run_dir / "metrics.json").write_text(json.dumps(summary, indent=2))
        with (self.run_dir / "metrics_steps.jsonl").open("a") as f:
            f.writelines(json.dumps(h) + "\n" for h in history)
        if grid is not None:
            run.tracker.log_image("samples", grid, step=cfg.trainer.max_steps)
        run.tracker.finish({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        return summary

    def embeddings(self):
        """The main rank encodes (or finds them cached); the others then read the cache."""
        cfg = self.cfg
        encode = functools.partial(
            encode_prompts,
            self.spec,
            read_prompts(cfg.data.prompts_path),
            cfg.teacher.negative_prompt,
            cfg.teacher.max_sequence_length,
            self.precision.teacher_dtype,
        )
        if self.is_main:
            where = self.placement.teacher_device(self.topo) if self.roles.has_teacher else self.device
            embeddings = encode(where, cfg.paths.cache_dir)
        _barrier(self.topo)
        return embeddings if self.is_main else encode(torch.device("cpu"), cfg.paths.cache_dir)

    def transfer_device(self) -> torch.device:
        """Where served targets travel: CUDA (NCCL) when teacher and students are on GPUs, else CPU (gloo)."""
        teacher_device = self.placement.teacher_device(self.topo)
        if teacher_device.type != "cuda":
            return torch.device("cpu")
        return self.device if self.roles.trains and not self.roles.has_teacher else teacher_device

    def build_run(self, teacher, batch_fn, student_group, state: dict | None) -> Run:
        from diffusers.optimization import get_scheduler
        from diffusers.training_utils import EMAModel
        from torch.nn.parallel import DistributedDataParallel

        cfg, roles, device = self.cfg, self.roles, self.device
        torch.manual_seed(cfg.seed)
        student = build_student(cfg.student, self.spec, self.precision.student_dtype)
        if cfg.student.init == "teacher" and state is None:
            init_from_teacher(student, self.spec)
        student.to(device).train()
        if cfg.trainer.gradient_checkpointing:
            student.transformer.enable_gradient_checkpointing()
        if cfg.trainer.compile_student:
            student.transformer.compile_repeated_blocks(**compile_kwargs(cfg.trainer.compile_mode))
        params = [p for p in student.parameters() if p.requires_grad]
        optimizer = instantiate(cfg.trainer.optimizer)(params, **({"fused": True} if device.type == "cuda" else {}))
        lr_scheduler = get_scheduler(
            cfg.trainer.lr_scheduler,
            optimizer,
            num_warmup_steps=cfg.trainer.warmup_steps,
            num_training_steps=cfg.trainer.max_steps,
        )
        scaler = torch.amp.GradScaler(device.type, enabled=self.precision.needs_grad_scaler)
        ema = EMAModel(params, decay=cfg.trainer.ema_decay) if cfg.trainer.ema_decay else None
        tracker = instantiate(cfg.logger) if self.is_main else NullTracker()
        if state is not None:
            student.load_state_dict(state["student"])
            optimizer.load_state_dict(state["optimizer"])
            lr_scheduler.load_state_dict(state["lr_scheduler"])
            scaler.load_state_dict(state["scaler"])
            if ema is not None and state["ema"] is not None:
                ema.load_state_dict(state["ema"])
            log.info("resuming at step %d", state["step"])
        if self.is_main:
            point = self.prepared.sweep_point or {}
            config = OmegaConf.to_container(cfg, resolve=True) | {"teacher_placement": self.placement.name}
            tracker.start(
                self.run_dir,
                config,
                state["tracker_run_id"] if state else None,
                group=point.get("group"),
                name=point.get("name"),
            )
        model = student
        if len(roles.students) > 1:
            model = DistributedDataParallel(
                student, device_ids=[device.index] if device.type == "cuda" else None, process_group=student_group
            )
        if roles.owner is not None:
            targets = RemoteTargets(roles.owner, self.spec.transformer_config, self.transfer_device())
        elif roles.served:
            targets = OwnerTargets(teacher, list(roles.served), batch_fn, self.transfer_device())
        elif cfg.trainer.teacher_whole_step:
            targets = WholeStepTargets(teacher, batch_fn, roles.dp_rank, cfg.trainer.grad_accum_steps)
        else:
            targets = LocalTargets(teacher)
        log.info(
            "rank %d (pid %d): student %.1fM params on %s; teacher %s (%s)",
            self.topo.rank,
            os.getpid(),
            _millions(student),
            device,
            self.placement.name,
            "here" if teacher is not None else f"served by rank {roles.owner}",
        )
        return Run(
            model=model,
            targets=targets,
            batch_fn=batch_fn,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            scaler=scaler,
            ema=ema,
            tracker=tracker,
            precision=self.precision,
            device=device,
            run_dir=self.run_dir,
            dp_rank=roles.dp_rank,
            is_main=self.is_main,
            student_group=student_group if self.topo.distributed else None,
        )

    def save_outputs(self, teacher, run: Run | None, embeddings) -> Path | None:
        """The final student, then the teacher-vs-student grid: rank 0 (which always holds a teacher)
        draws the teacher's column, the main rank the student's."""
        from wandistiller.samples import save_grid, student_images, teacher_images

        cfg, run_dir = self.cfg, self.run_dir
        if self.is_main:
            run.student.transformer.save_pretrained(run_dir / "student", safe_serialization=True)
            if run.ema is not None:
                run.ema.copy_to(p for p in run.student.parameters() if p.requires_grad)
                run.student.transformer.save_pretrained(run_dir / "student_ema", safe_serialization=True)
        n, steps = cfg.trainer.sample_prompts, cfg.trainer.sample_steps
        if n <= 0:
            return None
        # Rank 0 always holds a teacher; a sharded one needs every rank in its forwards.
        draws = self.topo.rank == 0 or getattr(self.placement, "collective", False)
        drawn = [teacher_images(teacher, embeddings, cfg.data, n, steps, cfg.seed) if draws else None]
        if self.topo.distributed:
            dist.broadcast_object_list(drawn, src=0)
        if not self.is_main:
            return None
        run.student.eval()
        mine = student_images(self.spec, run.student.transformer, embeddings, cfg.data, n, steps, cfg.seed)
        return save_grid(drawn[0], mine, embeddings.prompts[:n], run_dir / "samples.png")

    def summarize(self, history: list[dict], student, ranks: list[dict], wall_s: float) -> dict:
        cfg = self.cfg

        def median(key):
            values = [h[key] for h in history[1:] or history]  # the first step pays warm-up
            return statistics.median(values) if values else None

        peaks = {k: max(h[k] for h in history) for k in history[0] if k.endswith("_gib")} if history else {}
        students = sum(1 for r in ranks if "student" in r["role"])
        owner = next((r for r in ranks if "owner_idle_fraction" in r), {})
        return {
            "status": "completed",
            "teacher": cfg.teacher.name,
            "teacher_path": str(self.spec.path),
            "teacher_experts": len(self.spec.experts),
            "student_params_m": _millions(student),
            "placement": self.placement.name,
            "precision": self.precision.name,
            "world_size": self.topo.world_size,
            "training_ranks": students,
            "batch_size": cfg.trainer.batch_size * cfg.trainer.grad_accum_steps * students,
            "steps_run": len(history),
            "final_step": history[-1]["step"] if history else None,
            "loss_first": history[0]["loss"] if history else None,
            "loss_last": history[-1]["loss"] if history else None,
            "samples_per_s_median": median("samples_per_s"),
            "step_ms_median": median("step_ms"),
            "step_ms_stdev": statistics.pstdev([h["step_ms"] for h in history]) if history else None,
            "teacher_ms_median": median("teacher_ms"),
            "student_ms_median": median("student_ms"),
            "copy_ms_median": median("copy_ms") if history and "copy_ms" in history[0] else None,
            "owner_idle_fraction": owner.get("owner_idle_fraction"),
            "overrides": (self.prepared.sweep_point or {}).get("overrides"),
            **{f"{k}_max": v for k, v in peaks.items()},
            "ranks": ranks,
            "device": str(self.device),
            "hardware": {
                "cpu": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            },
            "wall_s": wall_s,
        }


def _gather(topo: Topology, item: dict) -> list[dict]:
    if not topo.distributed:
        return [item]
    items = [None] * topo.world_size
    dist.all_gather_object(items, item)
    return items


def _barrier(topo: Topology) -> None:
    if topo.distributed:
        dist.barrier()


def oom_report(error: Exception, prepared: Prepared) -> str:
    """One report for a CUDA out-of-memory: per-device memory now, and the planner's view."""
    lines = [f"CUDA out of memory on rank {os.environ.get('RANK', 0)}: {str(error).splitlines()[0]}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            lines.append(
                f"  GPU {i}: {torch.cuda.max_memory_allocated(i) / 2**30:.1f} GiB peak allocated here, "
                f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free"
            )
    if prepared.plan_table:
        lines += ["planner's estimates for this teacher and hardware:", prepared.plan_table]
    lines.append(
        "try: a placement the planner marks as fitting (teacher_placement=auto), a smaller "
        "trainer.batch_size, or trainer.gradient_checkpointing=true"
    )
    return "\n".join(lines)


def _millions(module: torch.nn.Module) -> float:
    return sum(p.numel() for p in module.parameters()) / 1e6


def _setup_logging(topo: Topology, run_dir: Path) -> None:
    """Spawned workers have no Hydra logging: rank 0 logs to the console and train.log, others to their own file."""
    fmt = logging.Formatter(f"[%(asctime)s][rank {topo.rank}][%(levelname)s] - %(message)s")
    handlers = [logging.FileHandler(run_dir / ("train.log" if topo.rank == 0 else f"train_rank{topo.rank}.log"))]
    if topo.rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
