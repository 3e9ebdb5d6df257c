"""`python -m wandistiller.plan`: the planner's table for a composed config (the planner: placements/planner.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from hydra.utils import get_class, instantiate

from wandistiller.compose import register_configs
from wandistiller.config import hardware_problem
from wandistiller.core.errors import UserError, exit_on_user_error
from wandistiller.core.hydra import auto_precision, compose_config
from wandistiller.core.precision import Precision
from wandistiller.job.checks import (
    check_missing,
    check_training_parts,
    check_values,
    method_passes,
    name_the_teacher,
)
from wandistiller.job.preflight import check_data, check_method_config, check_rope
from wandistiller.placements import Placement
from wandistiller.placements.advice import nothing_fits, plan_report, time_factor
from wandistiller.placements.planner import text_encoder_bytes, workload_of
from wandistiller.student.model import check_student
from wandistiller.teacher.fastpaths import check_quantize_setting
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.teacher.vae import check_latent_frames

USAGE = """usage: python -m wandistiller.plan [OVERRIDE ...]

Prints each teacher placement's memory estimate for the composed config (the same overrides as
`python -m wandistiller.train`) and the one `teacher_placement=auto` would choose. Plan on paper with
hardware.gpus=N hardware.gpu_memory_gib=G [hardware.host_memory_gib=H] (precision=auto then plans what a
run there would take: bf16 for N > 0); e.g.
  python -m wandistiller.plan teacher=wan2.2_t2v_a14b hardware.gpus=8 hardware.gpu_memory_gib=40
A run that does not fit gets a line naming what would (fewer resident blocks, a smaller batch, fp8, fewer frames);
where no setting fits, one error line says what is short and by how much (exit 2).
  python -m wandistiller.plan --rigs [--write]   the table of rigs in docs/PLANNER.md (--write rewrites it)"""


def main() -> None:
    """Compose the same config tree as training (no run folder, no log file) and print the plan."""
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(USAGE)
        return
    if "--rigs" in sys.argv[1:]:
        rigs(sys.argv[1:])
        return
    with exit_on_user_error():
        register_configs()  # a bad WANDISTILLER_PLUGINS is one line too
        flags = [a for a in sys.argv[1:] if a.startswith("-")]
        if flags:  # train's Hydra flags (-m, --cfg job, --multirun) plan nothing: not an override to fix
            raise UserError(
                f"{flags[0]} is not a planner option: it takes train's overrides alone (key=value), --rigs and --help; "
                "drop it (train's -m / --multirun sweep: plan each point on its own)"
            )
        cfg = compose_config(sys.argv[1:])
        check_missing(cfg)  # as train: `~teacher` is one line, not a traceback from the first read of it
        hardware = hardware_problem(cfg.hardware)  # before it is planned: hardware.gpus=-1 planned "no GPU"
        if hardware:
            raise UserError(hardware)
        check_values(cfg)  # what train refuses before planning (trainer.batch_size=0), refused here too
        name_the_teacher(cfg)
        method, _ = check_training_parts(cfg)  # the optimizer's and the method's own checks (lr=nan), as train's
        check_method_config(cfg, method)  # what train refuses whatever the placement, refused here too
        passes = method_passes(cfg, method)
        # precision=auto as a run on the planned hardware would take it, not as this machine would
        precision = Precision.from_config(auto_precision(cfg.precision, cfg.hardware.gpus))
        # The setting alone (int4 planned a bf16 table where train refuses it): the planned rig's GPU is on paper, and
        # this machine's build and capability cannot stand for it
        check_quantize_setting(cfg.teacher.quantize, precision.teacher_dtype)
        local = Path(str(cfg.teacher.path)).expanduser()
        spec = inspect_teacher(local) if local.is_dir() else None  # its folder read once, as train reads it first
        read = (spec.transformer_config, len(spec.experts)) if spec is not None else None
        planned = workload_of(cfg, precision.teacher_dtype, passes.networks, teacher=read)
        if planned is None:
            raise UserError(f"teacher.path={cfg.teacher.path!r}: no local config.json to plan from; download it first")
        if spec is not None:  # what train refuses of this teacher and its data on any machine, refused here too
            check_rope(cfg, check_student(cfg.student, spec.transformer_config), spec.transformer_config)
            check_latent_frames(spec.path, cfg.data.latent_frames)
            check_data(cfg, spec)
        clip = (cfg.data.latent_frames, time_factor(cfg.teacher.path))
        short = nothing_fits(*planned, cfg.data.latent_frames)
        if short:  # one line, nothing printed: no override of this run's helps, only more memory
            raise UserError(f"{run_keys(cfg)}: {short}")
        encoder = text_encoder_bytes(cfg.teacher, torch.tensor([], dtype=precision.teacher_dtype).element_size())
        line = precision_line(cfg, precision)
        print(plan_report(*planned, cfg.teacher.name, passes, line, configured(cfg), clip, text_encoder=encoder))


def rigs(args: list[str]) -> None:
    """`--rigs`: print docs/PLANNER.md's table of rigs as the planner makes it now; `--rigs --write` rewrites it."""
    from wandistiller.bench import rigs as table  # noqa: PLC0415 -- only this flag needs it

    with exit_on_user_error():
        extra = [a for a in args if a not in ("--rigs", "--write")]
        if extra:
            raise UserError(
                f"--rigs takes no overrides ({' '.join(extra)}): its runs are fixed (wandistiller/bench/rigs.py)"
            )
        if "--write" in args:
            table.write()
            print(f"wrote the table of rigs into {table.DOC}")
        else:
            print(table.table())


def run_keys(cfg) -> str:
    """The overrides that name the run a refusal is about: the teacher, and the hardware where it is on paper."""
    keys = [f"teacher={cfg.teacher.name}"]
    h = cfg.hardware
    if h.gpus is not None:
        keys += [f"hardware.gpus={h.gpus}", f"hardware.gpu_memory_gib={h.gpu_memory_gib:g}"]
    if h.host_memory_gib is not None:
        keys.append(f"hardware.host_memory_gib={h.host_memory_gib:g}")
    return " ".join(keys)


def configured(cfg) -> Placement | None:
    """The placement the config names, with its settings (None for `auto`, which the planner chooses), its
    settings checked as a run checks them (a bad `resident_blocks` is one line, not a wrong table)."""
    if getattr(get_class(cfg.teacher_placement._target_), "chosen_by_planner", False):
        return None
    placement = instantiate(cfg.teacher_placement)
    placement.check_settings()
    return placement


def precision_line(cfg, precision) -> str:
    """The plan's precision, and for precision=auto which hardware decided it."""
    line = f"precision: {precision.name} (teacher {precision.teacher_dtype}, student {precision.student_dtype})"
    if cfg.precision.name != "auto":
        return line
    where = "the planned hardware" if cfg.hardware.gpus is not None else "this machine"
    rule = "has GPUs" if precision.name == "bf16" else "has no GPU"
    return f"{line}: precision=auto, as {where} {rule} (precision=<fp32|bf16|fp16> plans another)"


if __name__ == "__main__":
    main()
