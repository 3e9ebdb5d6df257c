"""Everything that can refuse a run, in the order that refuses earliest, before the run folder is claimed.

`prepare` is the whole list: each refusal is one UserError line naming the key and the fix. It runs
once per job (in the Hydra job, or on rank 0 under torchrun), resolves `teacher_placement=auto`
through the planner, builds the placement once, and hands the workers a picklable `Prepared`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from wandistiller.config import compose_option
from wandistiller.core import precision as precision_options
from wandistiller.core.distributed import Topology, World, local_device, under_torchrun
from wandistiller.core.errors import UserError, write_to_log_files
from wandistiller.core.precision import Precision
from wandistiller.data import sources as data_sources
from wandistiller.job.resumed import recorded_overrides
from wandistiller.job.rundir import claim_run_dir, save_config
from wandistiller.placements import Placement, Serving, names_where
from wandistiller.placements import planner as plan
from wandistiller.placements.fastpaths import check_compile_mode, check_quantize, check_quantize_placement
from wandistiller.placements.memory import Hardware
from wandistiller.student.model import check_student, check_student_fits
from wandistiller.teacher.model import inspect_teacher, resolve_teacher_path

log = logging.getLogger("wandistiller")


@dataclass(frozen=True)
class Prepared:
    """What the job settled before any worker starts (picklable: it travels to spawned workers)."""

    run_dir: str
    teacher_path: str
    placement: Placement  # built once; `auto` already resolved
    resume_from: str | None
    plan_table: str | None
    sweep_point: dict | None = None  # group, name, overrides, choices: when this run is one point of a sweep
    overrides: list[str] | None = None  # the command line's (a resume's added to the first run's), for metrics.json


def prepare(cfg: DictConfig, topo: Topology, point: dict | None = None) -> Prepared:
    """The checks in order, then the run folder. `cfg.teacher_placement` is replaced by auto's choice."""
    check_known_keys(cfg)
    precision_options.resolve(cfg)
    check_values(cfg)
    check_targets(cfg)
    check_training_parts(cfg)
    check_tracker(cfg)
    check_folders(cfg)
    default_ranks(cfg, topo)
    world = World.of(cfg.distributed, topo)
    precision = Precision.from_config(cfg.precision)
    precision.check(local_device(topo))
    if Path(str(cfg.teacher.path)).expanduser().is_dir():  # a local teacher's files, before the planner reads them
        inspect_teacher(Path(str(cfg.teacher.path)).expanduser())
    placement, table = choose_placement(cfg, precision, world)  # on the teacher's JSON, before any download
    spec = inspect_teacher(resolve_teacher_path(cfg.teacher, cfg.paths.cache_dir))
    student = check_student(cfg.student, spec.transformer_config)  # the student against the teacher, from JSON alone
    check_student_room(cfg, student, spec.transformer_config)
    check_data(cfg)
    if table is None:  # a Hub teacher: planned now that its config is here
        placement, table = choose_placement(cfg, precision, world)
    check_combination(cfg, placement, world)
    run_dir = Path(cfg.paths.output_dir)
    overrides = recorded_overrides(run_dir, cfg.trainer.resume)
    resume_from = claim_run_dir(run_dir, cfg.trainer.resume)
    save_config(run_dir, cfg, resume_from)
    if table:
        show_plan(table, cfg.hardware.show_plan or _first_sweep_point(point))
    resumed = str(resume_from) if resume_from else None
    return Prepared(str(run_dir), str(spec.path), placement, resumed, table, point, overrides)


def default_ranks(cfg: DictConfig, topo: Topology) -> None:
    """A placement that needs its own process layout (gpu0: a teacher process beside the students) gets
    it when distributed.nproc_per_node is left at 1, so `teacher_placement=gpu0` alone runs on a GPU machine
    (and in a sweep beside single-process placements)."""
    cls = get_class(cfg.teacher_placement._target_)
    if not issubclass(cls, Placement) or cfg.distributed.nproc_per_node != 1 or topo.distributed:
        return
    if cls.default_ranks() < 2:
        return
    if cfg.teacher_placement.get("train_on_owner") or cfg.teacher_placement.get("debug_cpu"):
        return
    cfg.distributed.nproc_per_node = cls.default_ranks()
    log.info("%s: distributed.nproc_per_node=%d (one process per GPU)", cfg.teacher_placement._target_,
             cfg.distributed.nproc_per_node)  # fmt: skip


def show_plan(table: str, in_full: bool) -> None:
    """The planner's table on the terminal when asked for (or once per sweep), else one line; always in
    train.log, so a run's own folder says what the planner saw."""
    if in_full:
        log.info("teacher placement plan:\n%s", table)
        return
    write_to_log_files(f"teacher placement plan:\n{table}")
    rows = [r for r in table.splitlines()[3:] if r[12:17].strip() in ("yes", "no")]
    chosen = next((r for r in rows if r.endswith("<- chosen")), None)
    if chosen is None:
        return
    gpu, host = chosen[18:52].strip(), chosen[53:62].strip()
    fit = sum(r[12:17].strip() == "yes" for r in rows)
    where = "the table is in train.log, hardware.show_plan=true prints it"
    peaks = (f"peak GPU {gpu} GiB, " if gpu != "-" else "") + f"host {host} GiB"
    log.info("teacher placement: %s (%s; %d of %d placements fit here; %s)", chosen[:11].strip(), peaks, fit,
             len(rows), where)  # fmt: skip


def _first_sweep_point(point: dict | None) -> bool:
    from hydra.core.hydra_config import HydraConfig

    return point is not None and HydraConfig.initialized() and HydraConfig.get().job.num == 0


def check_known_keys(cfg: DictConfig) -> None:
    """Hydra's `+key=value` adds a key the schema does not know, so `+trainer.bacth_size=2` would be
    ignored in silence: every key under a typed node must be one of its schema's fields."""
    import dataclasses

    from wandistiller.config import TrainConfig

    def walk(schema, node: DictConfig, prefix: str) -> None:
        fields = {f.name: f for f in dataclasses.fields(schema)}
        for key in node.keys():
            if key not in fields:
                raise UserError(
                    f"{prefix}{key} is not a WanDistiller option (it was added with +); check its spelling "
                    f"(`python -m wandistiller.train --cfg job` lists the options)"
                )
            sub = _schema_of(schema, key)
            if sub is not None and isinstance(node[key], DictConfig):
                walk(sub, node[key], f"{prefix}{key}.")

    walk(TrainConfig, cfg, "")


def _schema_of(schema, key: str):
    """The dataclass that types `schema.key`, or None for an untyped (Any) node."""
    import dataclasses
    import typing

    hint = typing.get_type_hints(schema).get(key)
    return hint if dataclasses.is_dataclass(hint) else None


def check_values(cfg: DictConfig) -> None:
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
    for key, value in _at_least_zero(cfg):
        if value < 0:
            raise UserError(f"{key}={value} must be 0 or more")
    check_ranges(cfg)
    if d.latent_height % 2 or d.latent_width % 2:
        raise UserError(
            f"data.latent_height/latent_width ({d.latent_height}x{d.latent_width}) must be even (Wan patches 2x2)"
        )
    if cfg.distributed.nnodes > 1 and not cfg.distributed.rdzv_endpoint and not under_torchrun():
        raise UserError("distributed.nnodes>1 needs distributed.rdzv_endpoint=HOST:PORT of the first node")


def _at_least_zero(cfg: DictConfig) -> list[tuple[str, float]]:
    t = cfg.trainer
    return [
        ("trainer.warmup_steps", t.warmup_steps),
        ("trainer.keep_checkpoints", t.keep_checkpoints),
        ("trainer.sample_prompts", t.sample_prompts),
        ("trainer.val_every", t.val_every),
        ("trainer.sample_every", t.sample_every),
        ("student.hidden_kd_weight", cfg.student.hidden_kd_weight),
    ]


def check_ranges(cfg: DictConfig) -> None:
    """Numbers with a meaning only in some range; each refusal says the range (`None` = the default)."""
    t, d, teacher = cfg.trainer, cfg.data, cfg.teacher
    checks = [
        ("teacher.max_sequence_length", teacher.max_sequence_length, lambda v: 0 < v <= 4096, "in [1, 4096]"),
        ("data.latent_frames", d.latent_frames, lambda v: v <= MAX_LATENT, f"at most {MAX_LATENT}"),
        ("data.latent_height", d.latent_height, lambda v: v <= MAX_LATENT, f"at most {MAX_LATENT}"),
        ("data.latent_width", d.latent_width, lambda v: v <= MAX_LATENT, f"at most {MAX_LATENT}"),
        ("trainer.sample_steps", t.sample_steps, lambda v: v > 0, "a positive integer"),
        *data_sources.range_checks(d),  # each source's own keys (wandistiller/data/sources/)
        ("data.val_fraction", d.val_fraction, lambda v: 0 <= v < 1, "in [0, 1)"),
        ("trainer.ema_decay", t.ema_decay, lambda v: v is None or 0 <= v < 1, "in [0, 1), or null for no EMA"),
        ("trainer.max_grad_norm", t.max_grad_norm, lambda v: v is None or v > 0, "positive, or null for no clipping"),
        (
            "teacher.flow_shift",
            teacher.flow_shift,
            lambda v: v is None or 0 < v < math.inf,
            "positive and finite, or null",
        ),
        ("student.hidden_kd_weight", cfg.student.hidden_kd_weight, math.isfinite, "a finite number"),
        ("seed", cfg.seed, lambda v: 0 <= v < 2**63, "in [0, 2**63)"),
        ("teacher.guidance_scale", teacher.guidance_scale, math.isfinite, "a finite number"),
        ("teacher.guidance_scale_2", teacher.guidance_scale_2, lambda v: v is None or math.isfinite(v), "finite"),
        ("distributed.timeout_min", cfg.distributed.timeout_min, lambda v: v > 0, "positive (minutes)"),
    ] + [
        (f"hardware.{k}", v, lambda v: v is None or v > 0, "positive, or null to detect")
        for k, v in cfg.hardware.items()
        if not k.startswith("headroom") and k != "show_plan"  # the headroom may be 0; memory.Hardware checks its range
    ]
    for key, value, ok, what in checks:
        if not ok(value) or (isinstance(value, float) and math.isnan(value)):
            raise UserError(f"{key}={value} must be {what}")


MAX_LATENT = 1024  # latent frames/rows/columns: Wan's 720p x 81 frames is 21 x 90 x 160


def check_student_room(cfg: DictConfig, student: dict, teacher: dict, hw: Hardware | None = None) -> None:
    """The student fits this machine (weights estimated from its config), and its rope table covers the latent grid."""
    hw = hw or Hardware.detect(cfg.hardware)
    check_student_fits(student, teacher, hw.host_bytes, hw.gpu_bytes)
    d, patch = cfg.data, list(student.get("patch_size") or (1, 2, 2))
    for (key, size), p in zip((("latent_frames", d.latent_frames), ("latent_height", d.latent_height),
                               ("latent_width", d.latent_width)), patch):  # fmt: skip
        for who, config in (("student", student), ("teacher", teacher)):
            rope = config.get("rope_max_seq_len", 1024)
            if size // p > rope:
                raise UserError(
                    f"data.{key}={size} is {size // p} patches, more than the {who}'s rope_max_seq_len={rope}; "
                    f"use data.{key}<={rope * p} (or a {who} with a larger rope_max_seq_len)"
                )


MAX_LR = 10.0  # far above any learning rate that trains a transformer: a larger one is a typo (1e4 for 1e-4)


def check_training_parts(cfg: DictConfig) -> None:
    """The optimizer and LR schedule built once on a one-number parameter: their own argument checks
    (torch's "Invalid learning rate", a schedule's missing option) run now, not after the teacher loads."""
    import torch
    from diffusers.optimization import get_scheduler

    t = cfg.trainer
    lr = t.optimizer.get("lr") if isinstance(t.optimizer, DictConfig) else None
    if isinstance(lr, (int, float)) and not (math.isfinite(lr) and lr <= MAX_LR):  # negative: torch says
        raise UserError(f"trainer.optimizer.lr={lr} must be a finite number in [0, {MAX_LR:g}]; use e.g. 1e-4")
    try:
        optimizer = instantiate(t.optimizer)([torch.nn.Parameter(torch.zeros(1))])
    except (ValueError, TypeError, RuntimeError) as e:
        raise UserError(f"trainer.optimizer: {_first_line(e)}; fix the value under trainer.optimizer") from None
    try:
        get_scheduler(str(t.lr_scheduler), optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=t.max_steps)
    except (ValueError, TypeError) as e:
        raise UserError(f"trainer.lr_scheduler={t.lr_scheduler}: {_first_line(e)}; pick another schedule") from None


def _first_line(error: Exception) -> str:
    words = str(error).strip().splitlines()
    return words[0] if words else type(error).__name__


def check_folders(cfg: DictConfig) -> None:
    """The run folder and the cache can be created and written: checked before either is touched."""
    from wandistiller.core.files import folder_problem

    for key, folder in (("hydra.run.dir", cfg.paths.output_dir), ("paths.cache_dir", cfg.paths.cache_dir)):
        problem = folder_problem(Path(str(folder)))
        if problem:
            raise UserError(f"{key}: {problem}; choose another folder with {key}=…")


def check_data(cfg: DictConfig) -> None:
    """The prompts files, then what the chosen data source checks itself (data.latents=images: its images)."""
    data_sources.check(cfg.data)


def check_tracker(cfg: DictConfig) -> None:
    """Each logger's own refusals (`check`, e.g. logger.wandb.mode=online needs a wandb key), without the network;
    an entry of `logger` that is not a logger is one line listing the shipped ones."""
    from hydra.utils import get_object

    from wandistiller.config import CONF_DIR

    for key, node in cfg.logger.items():
        if not isinstance(node, DictConfig) or "_target_" not in node:
            names = ", ".join(sorted(p.stem for p in (CONF_DIR / "logger").glob("*.yaml")))
            raise UserError(
                f"logger.{key}={node!r} is not a logger; `logger` names loggers ({names}), each with its keys under "
                "its name: e.g. logger=[wandb,csv] logger.wandb.mode=online"
            )
        check = getattr(get_object(node._target_), "check", None)  # a logger of your own need not have one
        if callable(check):
            check(node, f"logger.{key}")


def check_targets(cfg: DictConfig) -> None:
    """Every `_target_` a user may swap names something importable, before anything else runs."""
    from hydra.utils import get_object

    listed = [f"{group}.{k}" for group in ("logger", "hooks") for k, v in cfg[group].items()
              if isinstance(v, DictConfig) and "_target_" in v]  # fmt: skip
    for key in ("recipe", "student", "trainer.loss", "trainer.optimizer", *listed, "teacher_placement"):
        target = OmegaConf.select(cfg, f"{key}._target_")
        try:
            get_object(target)
        except Exception:  # ImportError, AttributeError, ValueError: all "cannot find it"
            raise UserError(
                f"{key}._target_={target!r} cannot be imported; name a class or function as module.name (on PYTHONPATH)"
            ) from None
    from wandistiller.core.extensions import check_signatures

    check_signatures(cfg)


def check_interpolations(cfg: DictConfig) -> None:
    """Every `${…}` resolves (an unset environment variable, a key that does not exist): one line naming
    the key that holds the bad one (not a key that merely refers to it), before any value is used."""
    import re

    from omegaconf.errors import OmegaConfBaseException

    failing = []
    for key, raw in _leaves(OmegaConf.to_container(cfg, resolve=False), ""):
        if isinstance(raw, str) and "${" in raw:
            try:
                OmegaConf.select(cfg, key, throw_on_missing=False)
            except OmegaConfBaseException as e:
                failing.append((key, raw, str(getattr(e, "msg", e)).strip().splitlines()[0]))
    if failing:
        names = re.findall(r"'([^']+)'", failing[0][2])  # the variable or key it could not find
        key, raw, message = next((f for f in failing if any(n in f[1] for n in names)), failing[0])
        raise UserError(f"{key}={raw}: {message}; fix the interpolation (or set the variable it reads)")


def _leaves(node, prefix: str):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{prefix}[{i}]" if prefix else str(i))
    else:
        yield prefix, node


def choose_placement(cfg: DictConfig, precision: Precision, world: World) -> tuple[Placement, str | None]:
    """The placement to run, `auto` resolved (its config node replaced by the choice's, composed by Hydra);
    one that cannot fit is refused, naming one that can. The table is None while the teacher's config is
    not on disk yet (a Hub id not downloaded)."""
    auto = cfg.teacher_placement._target_.endswith(".AutoPlacement")
    placement = None if auto else instantiate(cfg.teacher_placement)
    if placement is not None:
        placement.check(precision, world)
        check_quantize_placement(cfg.teacher.quantize, placement)  # before the planner calls it a misfit
    found = plan.planning_teacher_config(cfg.teacher, cfg.paths.cache_dir)
    if found is None:
        return placement, None
    hw = Hardware.detect(cfg.hardware)
    # the student's size and rope table from its JSON, before the planner builds a meta skeleton of it
    check_student_room(cfg, check_student(cfg.student, found[0]), found[0], hw)
    w, hw = plan.workload_of(cfg, precision.teacher_dtype, world.nproc_per_node, hw=hw)
    estimates = plan.plan(w, hw, placement)
    best = plan.choose(estimates)
    if auto:
        placement, best = _resolve_auto(cfg, estimates, hw, precision, world)
    mine = next(e for e in estimates if e.placement == placement.name)
    if not mine.fits and not placement.debug_cpu:
        other = f"use teacher_placement={best.placement}" if best else "no placement fits; add memory"
        raise UserError(
            f"teacher_placement={placement.name} will not fit: it needs {mine.need()} and this machine has "
            f"{hw.describe()}; {other} (python -m wandistiller.plan shows the table)"
        )
    placement.with_plan(mine)
    return placement, plan.format_table(estimates, hw, placement.name, w)


def _resolve_auto(cfg: DictConfig, estimates, hw: Hardware, precision: Precision, world: World):
    """The fastest placement that fits and can run with this process layout; `cfg.teacher_placement` becomes
    its config node, composed by Hydra (its schema, defaults and interpolations apply as if it had been named)."""
    on_paper = cfg.hardware.gpus is not None  # planning for other hardware: this machine cannot check it
    for estimate in estimates:  # fastest first
        if not estimate.fits:
            if estimate.headroom_excludes:  # it would fit the memory, not the margin the user asked to keep
                log.info(
                    "teacher_placement=auto: not %s, the headroom excludes it: %s",
                    estimate.placement,
                    estimate.headroom_excludes,
                )
            continue
        # In the run's tree, so interpolations (disk's ${paths.cache_dir}) resolve there.
        cfg.teacher_placement = compose_option("teacher_placement", estimate.placement)
        placement = instantiate(cfg.teacher_placement)
        try:
            if not on_paper:
                placement.check(precision, world)
        except UserError as refused:
            log.info("teacher_placement=auto: not %s (%s)", estimate.placement, refused)
            continue
        return placement, estimate
    raise UserError(
        "teacher_placement=auto: no placement fits this teacher on this hardware "
        f"({hw.describe()}); use precision=bf16, a smaller trainer.batch_size or more memory"
    )


def check_combination(cfg: DictConfig, placement: Placement, world: World) -> None:
    """Options that each work, but not together."""
    teacher_dtype = Precision.from_config(cfg.precision).teacher_dtype
    check_quantize(cfg.teacher.quantize, placement.teacher_device(Topology()), teacher_dtype)
    check_compile_mode(cfg.trainer.compile_mode, cfg.trainer.compile_student)
    if cfg.teacher.compile and not placement.compilable:
        able = ", ".join(names_where(lambda cls: cls.compilable))
        raise UserError(
            f"teacher.compile=true works with the placements that run a whole teacher in one process ({able}), not "
            f"with teacher_placement={placement.name}; drop teacher.compile or pick one of those"
        )
    if cfg.trainer.teacher_whole_step and placement.serving != Serving.LOCAL and world.nproc_per_node > 1:
        local = names_where(lambda cls: cls.serving == Serving.LOCAL)
        raise UserError(
            f"trainer.teacher_whole_step=true batches the targets of a rank's own teacher, and with "
            f"teacher_placement={placement.name} a teacher owner serves them; use {', '.join(local[:-1])} or "
            f"{local[-1]}, or drop trainer.teacher_whole_step"
        )
