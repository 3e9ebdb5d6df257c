"""`python -m wandistiller.train …`: the Hydra entrypoint, and `run(cfg)`, the plain function behind it."""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from wandistiller.checkpoint import list_checkpoints, load_checkpoint, resolve_resume
from wandistiller.config import register_configs
from wandistiller.data import encode_prompts, read_prompts
from wandistiller.errors import UserError, exit_on_user_error
from wandistiller.loop import Run, train_loop
from wandistiller.precision import Precision
from wandistiller.student import build_student, init_from_teacher
from wandistiller.teacher import inspect_teacher, resolve_teacher_path

log = logging.getLogger("wandistiller")
register_configs()
# Wan keeps its norms in fp32 on purpose (diffusers' _keep_in_fp32_modules); torch warns on every call.
warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")


@hydra.main(version_base=None, config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        run(cfg)


def run(cfg: DictConfig) -> dict:
    """Distill the configured teacher into the configured student; returns the metrics.json summary."""
    started = time.time()
    run_dir = Path(cfg.paths.output_dir)
    check_config(cfg)
    resume_from = claim_run_dir(run_dir, cfg.trainer.resume)
    device = student_device()
    precision = Precision.from_config(cfg.precision)
    precision.check(device)
    placement = instantiate(cfg.teacher_placement)
    placement.check(precision)
    spec = inspect_teacher(resolve_teacher_path(cfg.teacher))
    torch.manual_seed(cfg.seed)
    student = build_student(cfg.student, spec, precision.student_dtype)
    prompts = read_prompts(cfg.data.prompts_path)
    save_config(run_dir, cfg, resume_from)
    log.info(
        "teacher %s (%s, %d expert(s)) on %s; student %.1fM params on %s; precision %s",
        cfg.teacher.name,
        spec.path,
        len(spec.experts),
        placement.name,
        _millions(student),
        device,
        precision.name,
    )

    embeddings = encode_prompts(
        spec,
        prompts,
        cfg.teacher.negative_prompt,
        cfg.teacher.max_sequence_length,
        precision.teacher_dtype,
        placement.device,
        cfg.paths.cache_dir,
    )
    teacher = placement.load(spec, cfg.teacher, precision)
    if cfg.student.init == "teacher" and resume_from is None:
        init_from_teacher(student, teacher.experts[0])
    student.to(device).train()
    if cfg.trainer.gradient_checkpointing:
        student.transformer.enable_gradient_checkpointing()

    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel

    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = instantiate(cfg.trainer.optimizer)(params, **({"fused": True} if device.type == "cuda" else {}))
    lr_scheduler = get_scheduler(
        cfg.trainer.lr_scheduler,
        optimizer,
        num_warmup_steps=cfg.trainer.warmup_steps,
        num_training_steps=cfg.trainer.max_steps,
    )
    scaler = torch.amp.GradScaler(device.type, enabled=precision.needs_grad_scaler)
    ema = EMAModel(params, decay=cfg.trainer.ema_decay) if cfg.trainer.ema_decay else None
    tracker = instantiate(cfg.logger)

    start_step, tracker_run_id = 0, None
    if resume_from is not None:
        state = load_checkpoint(resume_from)
        student.load_state_dict(state["student"])
        optimizer.load_state_dict(state["optimizer"])
        lr_scheduler.load_state_dict(state["lr_scheduler"])
        scaler.load_state_dict(state["scaler"])
        if ema is not None and state["ema"] is not None:
            ema.load_state_dict(state["ema"])
        start_step, tracker_run_id = state["step"], state["tracker_run_id"]
        log.info("resuming from %s (step %d)", resume_from, start_step)
        if start_step >= cfg.trainer.max_steps and (run_dir / "metrics.json").is_file():
            log.info("nothing to do: the run already reached trainer.max_steps=%d", cfg.trainer.max_steps)
            return json.loads((run_dir / "metrics.json").read_text())
    tracker.start(run_dir, OmegaConf.to_container(cfg, resolve=True), tracker_run_id)

    flow_shift = cfg.teacher.flow_shift or spec.flow_shift
    loop = Run(
        student=student,
        teacher=teacher,
        embeddings=embeddings,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        scaler=scaler,
        ema=ema,
        tracker=tracker,
        precision=precision,
        device=device,
        run_dir=run_dir,
        seed=cfg.seed,
        flow_shift=flow_shift,
    )
    history = train_loop(loop, cfg.trainer, cfg.data, cfg.student.hidden_kd_weight, start_step)

    student.transformer.save_pretrained(run_dir / "student", safe_serialization=True)
    if ema is not None:
        ema.copy_to(params)  # the EMA weights are the ones worth keeping; saved beside the raw ones
        student.transformer.save_pretrained(run_dir / "student_ema", safe_serialization=True)
    student.eval()
    if cfg.trainer.sample_prompts > 0:
        from wandistiller.samples import sample_grid

        grid = sample_grid(
            teacher,
            student.transformer,
            embeddings,
            cfg.data,
            cfg.trainer.sample_prompts,
            cfg.trainer.sample_steps,
            cfg.seed,
            run_dir / "samples.png",
        )
        tracker.log_image("samples", grid, step=cfg.trainer.max_steps)
    summary = summarize(cfg, history, placement.name, precision.name, student, teacher, device, time.time() - started)
    (run_dir / "metrics.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "metrics_steps.jsonl").open("a").writelines(json.dumps(h) + "\n" for h in history)
    tracker.finish({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
    log.info(
        "done: %d steps, loss %.4f -> %.4f; outputs in %s",
        summary["steps_run"],
        summary["loss_first"],
        summary["loss_last"],
        run_dir,
    )
    return summary


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
    ]:
        if value <= 0:
            raise UserError(f"{key}={value} must be a positive integer")
    if d.latent_height % 2 or d.latent_width % 2:
        raise UserError(
            f"data.latent_height/latent_width ({d.latent_height}x{d.latent_width}) must be even (Wan patches 2x2)"
        )
    if d.latents != "gaussian":
        raise UserError(f"data.latents={d.latents!r} is unknown; use gaussian")
    if cfg.distributed.nproc_per_node != 1 or cfg.distributed.nnodes != 1:
        raise UserError("distributed.nproc_per_node/nnodes: multi-process training is not in this version yet; use 1")


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


def save_config(run_dir: Path, cfg: DictConfig, resume_from: Path | None) -> None:
    """The composed config, as Hydra would write it; a resumed run keeps the first run's and adds its own."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(exist_ok=True)
    name = "config.yaml" if not (hydra_dir / "config.yaml").exists() else f"config_resume_{int(time.time())}.yaml"
    OmegaConf.save(cfg, hydra_dir / name)
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized() and name == "config.yaml":
        OmegaConf.save(HydraConfig.get().overrides.task, hydra_dir / "overrides.yaml")


def student_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def summarize(
    cfg, history: list[dict], placement: str, precision: str, student, teacher, device, wall_s: float
) -> dict:
    def median(key):
        values = [h[key] for h in history[1:] or history]  # the first step pays warm-up
        return statistics.median(values) if values else None

    peaks = {k: max(h[k] for h in history) for k in history[0] if k.endswith("_gib")} if history else {}
    return {
        "status": "completed",
        "teacher": cfg.teacher.name,
        "teacher_path": str(teacher.spec.path),
        "teacher_experts": len(teacher.experts),
        "teacher_params_m": sum(_millions(e) for e in teacher.experts),
        "student_params_m": _millions(student),
        "placement": placement,
        "precision": precision,
        "world_size": 1,
        "batch_size": cfg.trainer.batch_size * cfg.trainer.grad_accum_steps,
        "steps_run": len(history),
        "final_step": history[-1]["step"] if history else None,
        "loss_first": history[0]["loss"] if history else None,
        "loss_last": history[-1]["loss"] if history else None,
        "samples_per_s_median": median("samples_per_s"),
        "step_ms_median": median("step_ms"),
        "step_ms_stdev": statistics.pstdev([h["step_ms"] for h in history]) if history else None,
        "teacher_ms_median": median("teacher_ms"),
        "student_ms_median": median("student_ms"),
        **{f"{k}_max": v for k, v in peaks.items()},
        "device": str(device),
        "hardware": {
            "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        },
        "wall_s": wall_s,
    }


def _millions(module: torch.nn.Module) -> float:
    return sum(p.numel() for p in module.parameters()) / 1e6


if __name__ == "__main__":
    main()
