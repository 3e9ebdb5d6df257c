"""`python -m wandistiller.plan`: the planner's table for a composed config (the planner: placements/planner.py)."""

from __future__ import annotations

import sys

from hydra.utils import get_class, instantiate

from wandistiller.compose import register_configs
from wandistiller.config import hardware_problem
from wandistiller.core.errors import UserError, exit_on_user_error
from wandistiller.core.hydra import auto_precision, compose_config
from wandistiller.core.precision import Precision
from wandistiller.job.checks import built_quietly, name_the_teacher
from wandistiller.job.preflight import check_method_config
from wandistiller.placements import Placement
from wandistiller.placements.planner import plan_report, time_factor, workload_of

USAGE = """usage: python -m wandistiller.plan [OVERRIDE ...]

Prints each teacher placement's memory estimate for the composed config (the same overrides as
`python -m wandistiller.train`) and the one `teacher_placement=auto` would choose. Plan on paper with
hardware.gpus=N hardware.gpu_memory_gib=G [hardware.host_memory_gib=H] (precision=auto then plans what a
run there would take: bf16 for N > 0); e.g.
  python -m wandistiller.plan teacher=wan2.2_t2v_a14b hardware.gpus=8 hardware.gpu_memory_gib=40"""


def main() -> None:
    """Compose the same config tree as training (no run folder, no log file) and print the plan."""
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(USAGE)
        return
    with exit_on_user_error():
        register_configs()  # a bad WANDISTILLER_PLUGINS is one line too
        cfg = compose_config(sys.argv[1:])
        hardware = hardware_problem(cfg.hardware)  # before it is planned: hardware.gpus=-1 planned "no GPU"
        if hardware:
            raise UserError(hardware)
        name_the_teacher(cfg)
        method = built_quietly(cfg.method)
        check_method_config(cfg, method)  # what train refuses whatever the placement, refused here too
        passes = method.passes(cfg.trainer.grad_accum_steps, cfg.trainer.teacher_whole_step)
        # precision=auto as a run on the planned hardware would take it, not as this machine would
        precision = Precision.from_config(auto_precision(cfg.precision, cfg.hardware.gpus))
        planned = workload_of(cfg, precision.teacher_dtype)
        if planned is None:
            raise UserError(f"teacher.path={cfg.teacher.path!r}: no local config.json to plan from; download it first")
        clip = (cfg.data.latent_frames, time_factor(cfg.teacher.path))
        print(plan_report(*planned, cfg.teacher.name, passes, precision_line(cfg, precision), configured(cfg), clip))


def configured(cfg) -> Placement | None:
    """The placement the config names, with its settings (None for `auto`, which the planner chooses), its
    settings checked as a run checks them (a bad `resident_blocks` is one line, not a wrong table)."""
    if getattr(get_class(cfg.teacher_placement._target_), "chosen_by_planner", False):
        return None
    placement = instantiate(cfg.teacher_placement)
    if hasattr(placement, "check_resident_blocks"):
        placement.check_resident_blocks()
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
