"""Everything that can refuse a run, in the order that refuses earliest, before the run folder is claimed
(the config's own values first: wandistiller/job/checks.py; each data source's in its module).

`prepare` is the whole list: each refusal is one UserError line naming the key and the fix. It runs
once per job (in the Hydra job, or on rank 0 under torchrun), resolves `teacher_placement=auto`
through the planner, builds the placement once, and hands the workers a picklable `Prepared`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from wandistiller.core.arch import Layout, rope_table
from wandistiller.core.distributed import Topology, World, local_device
from wandistiller.core.errors import UserError, write_to_log_files
from wandistiller.core.hydra import compose_config, compose_option, resolve_precision
from wandistiller.core.precision import Precision
from wandistiller.core.registry import registered
from wandistiller.data import sources as data_sources
from wandistiller.data.sources import CONTENTS, contents_problem, record_contents
from wandistiller.job.checks import (
    check_folders,
    check_hooks,
    check_known_keys,
    check_second_scale,
    check_targets,
    check_tracker,
    check_training_parts,
    check_values,
    method_passes,
    name_the_teacher,
)
from wandistiller.job.resumed import continuing, recorded_overrides
from wandistiller.job.rundir import claim_run_dir, save_config
from wandistiller.placements import Placement, Serving, advice, names_where
from wandistiller.placements import planner as plan
from wandistiller.placements.base import check_adapters_on_teacher, check_quantize_placement
from wandistiller.placements.memory import Estimate, GiB, Hardware
from wandistiller.recipe.context import Prepared
from wandistiller.recipe.losses import Loss
from wandistiller.state.checkpoint import (
    check_method,
    check_student_identity,
    check_teacher,
    checkpoint_step,
    list_checkpoints,
    resume_candidate,
)
from wandistiller.student.compile import check_compile_mode
from wandistiller.student.lora import is_lora, lora_settings
from wandistiller.student.model import check_student, check_student_fits
from wandistiller.teacher.fastpaths import check_attention_backend, check_quantize
from wandistiller.teacher.finetune import absolute, with_loras
from wandistiller.teacher.image import TEXT_TOKENS
from wandistiller.teacher.spec import (
    TeacherSpec,
    check_teacher_path,
    inspect_teacher,
    read_json,
    resolve_teacher_path,
)
from wandistiller.teacher.vae import check_latent_frames

log = logging.getLogger("wandistiller")


@dataclass(frozen=True)
class Plan:
    """The planner's word on this run: every placement's estimate, that of the placement that runs, and their table."""

    estimates: list[Estimate]
    chosen: Estimate
    table: str
    teacher_config: dict  # the teacher's transformer config it planned from
    student_config: dict  # the student's, checked against that one (check_student) and its room on this machine


def prepare(cfg: DictConfig, topo: Topology, point: dict | None = None) -> Prepared:
    """The checks in order, then the run folder. `cfg.teacher_placement` is replaced by auto's choice."""
    check_known_keys(cfg)
    name_the_teacher(cfg)
    resolve_precision(cfg)
    check_values(cfg)
    check_hooks(cfg)
    check_targets(cfg)
    check_folders(cfg)  # the cache first: the embedded teachers' paths lie in it
    check_teacher_path(cfg.teacher, cfg.paths.cache_dir)  # before the imports of the checks below
    method, loss = check_training_parts(cfg)  # built once here: every later check (and the run's method) uses them
    if is_lora(cfg.student):
        check_lora_training(cfg, loss)
    check_tracker(cfg)
    default_ranks(cfg, topo)
    world = World.of(cfg.distributed, topo)
    precision = Precision.from_config(cfg.precision)
    precision.check(local_device(topo))
    run_dir = Path(cfg.paths.output_dir)
    found = resume_candidate(cfg.trainer.resume, run_dir, refuse=True)  # refused before the folder is claimed
    check_named_resume(run_dir, cfg.trainer.resume)
    spec, student, placement, planned = teacher_and_student(cfg, precision, world, method, loss, found)
    overrides = recorded_overrides(run_dir, cfg.trainer.resume)
    check_resumed(cfg, found, spec, method)  # before the folder is claimed: a refused resume writes nothing
    check_data_kept(run_dir, cfg, found)
    resume_from = claim_run_dir(run_dir, cfg.trainer.resume)
    if resume_from != found:  # what another process left meanwhile (the folder is locked now)
        check_resumed(cfg, resume_from, spec, method)
    saved = save_config(run_dir, cfg, resume_from)
    if not (run_dir / CONTENTS).is_file():  # its first launch here (a new run, or a checkpoint named by path): what
        record_contents(run_dir, cfg.data)  # its data files hold now, which a resume and a later eval are held to
    continuing(run_dir)  # the resume is accepted: "continuing with the run's saved config", now
    if planned:
        show_plan(planned, cfg.hardware.show_plan or _first_sweep_point(point))
    resumed = str(resume_from) if resume_from else None
    table = planned.table if planned else None
    return Prepared(
        run_dir=str(run_dir),
        teacher_path=str(spec.path),
        placement=placement,
        resume_from=resumed,
        plan_table=table,
        method=method,
        spec=spec,
        student_config=student,
        sweep_point=point,
        overrides=overrides,
        resume_config=str(saved) if resume_from else None,
    )


def teacher_and_student(
    cfg: DictConfig, precision: Precision, world: World, method, loss: Loss, resumed: Path | None = None
):
    """(the teacher's spec, the student's checked config, the placement, the plan): the teacher inspected (its
    LoRAs checked against it, no weights read), the student against it, the placement chosen on the teacher's JSON
    before any download, and their combination checked. `cfg.teacher_placement` is replaced by auto's choice.
    `resumed`: the checkpoint a resume continues, whose record a local teacher is held to first."""
    local = Path(str(cfg.teacher.path)).expanduser()
    seen = inspect_teacher(local) if local.is_dir() else None  # a local teacher's files, before the planner reads them
    if seen is not None and not local.is_absolute():  # saved absolute, as teacher.lora: eval, export from elsewhere
        local = local.absolute()
        cfg.teacher.path = str(local)
    held = None  # `seen` with its LoRAs, where a resume needed them first
    if seen is not None and resumed is not None:
        # A teacher folder since filled with another model is said as that, before any check of the run against it
        # (its frames, its student, its plan) would name a key to change in a run that only needs its teacher back.
        held = with_loras(seen, cfg.teacher.get("lora"))
        check_teacher(resumed, held, bool(cfg.trainer.get("allow_other_teacher", False)), is_lora(cfg.student))
    if seen is not None:  # the method's own networks against the teacher's shape (a LoRA's rank), before the planner
        method.check_teacher(seen.transformer_config)  # sizes them: its line names the key, the planner's would not
    placement, planned = choose_placement(cfg, precision, world, method)  # on the teacher's JSON, before any download
    path = resolve_teacher_path(cfg.teacher, cfg.paths.cache_dir)
    spec = seen if seen is not None and path == local else inspect_teacher(path)
    if spec is not seen:  # a teacher read from elsewhere (a Hub id, now downloaded): checked against it here
        method.check_teacher(spec.transformer_config)
    # A fine-tuned teacher: its LoRAs checked against it, no weights (read once: a resume's were read above).
    spec = held if held is not None and spec is seen else with_loras(spec, cfg.teacher.get("lora"))
    if spec.loras:  # saved with absolute paths: a later eval or export from another directory reads the same files
        cfg.teacher.lora = absolute(cfg.teacher.lora)
    if planned is not None and planned.teacher_config == spec.transformer_config:
        student = planned.student_config  # checked, with its room, against this very config by the planner's call
    else:
        student = check_student(cfg.student, spec.transformer_config)  # the student against the teacher, JSON alone
        check_student_room(cfg, student, spec.transformer_config)
    # A clip the teacher's VAE can make; a resume into its own saved config (auto) keeps its frames, one of a
    # checkpoint named by path takes this command line's.
    check_latent_frames(spec.path, cfg.data.latent_frames, resumed is not None and cfg.trainer.resume == "auto")
    check_data(cfg, spec)
    check_second_scale(cfg.teacher, len(spec.experts))
    if planned is None:  # a Hub teacher: planned now that its config is here
        placement, planned = choose_placement(cfg, precision, world, method)
    assert placement is not None  # the teacher's config is here now: named or chosen
    check_combination(cfg, placement, world, method)
    check_layers(loss, spec.transformer_config, student, placement)
    return spec, student, placement, planned


def check_named_resume(run_dir: Path, resume: str | None) -> None:
    """A checkpoint named by path (not `auto`) starts a run folder of its own with this command line's config; into
    a folder that already holds checkpoints (its own run's, say) the claim refuses it, but only after the teacher
    and student were checked against this command line's config, not the run's (the default teacher's line offered
    trainer.allow_other_teacher). Said first, with both ways on."""
    if resume in (None, "auto"):
        return
    earlier = list_checkpoints(run_dir)
    if earlier:
        raise UserError(
            f"trainer.resume={resume}: the run folder {run_dir} already holds checkpoints (up to {earlier[-1].name}), "
            "and a checkpoint named by path continues in a new run folder with this command line's config; continue "
            "this run with its saved config by trainer.resume=auto, or that checkpoint in a new folder with "
            "hydra.run.dir=…"
        )


def check_data_kept(run_dir: Path, cfg: DictConfig, checkpoint: Path | None) -> None:
    """A resume in its run folder refuses, in one line, data files changed since the run's first launch (files
    added, removed, recaptioned): its held-out split would be another, and what it held out would be trained on."""
    if checkpoint is None:
        return
    problem = contents_problem(run_dir, cfg.data)  # None for a run that held out prompts of its own
    if problem:
        raise UserError(
            f"trainer.resume: {problem}, so its held-out split would be another, and some of what it held out would "
            "be trained on; restore the data as the run had it, or continue its latest checkpoint in a new folder "
            "(trainer.resume=<run>/checkpoints/step_… hydra.run.dir=<a new folder>)"
        )


def check_resumed(cfg: DictConfig, checkpoint: Path | None, spec, method) -> None:
    """A checkpoint resumed against what it recorded: its teacher, and the method it was trained with (its name and
    the settings that change what it trains: `Method.identity`)."""
    if checkpoint is None:
        return
    step, last = checkpoint_step(checkpoint), cfg.trainer.max_steps
    if isinstance(last, int) and step > last:  # the loop would run no step and save the checkpoint's student as final
        raise UserError(
            f"trainer.max_steps={last} is below step {step}, where trainer.resume={cfg.trainer.resume} continues "
            f"({checkpoint.name}): nothing is left to train; give trainer.max_steps={step} or more to go on, or take "
            f"an earlier student with --checkpoint step_N (python -m wandistiller.eval or export)"
        )
    check_teacher(checkpoint, spec, bool(cfg.trainer.get("allow_other_teacher", False)), is_lora(cfg.student))
    check_method(checkpoint, method.identity(), cfg.trainer.resume)
    check_student_identity(checkpoint, student_identity(cfg), cfg.trainer.resume)


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
    log.info(
        "%s: distributed.nproc_per_node=%d (one process per GPU)",
        cfg.teacher_placement._target_,
        cfg.distributed.nproc_per_node,
    )


def show_plan(planned: Plan, in_full: bool) -> None:
    """The planner's table on the terminal when asked for (or once per sweep), else one line from the chosen
    estimate; always in train.log, so a run's own folder says what the planner saw."""
    if in_full:
        log.info("teacher placement plan:\n%s", planned.table)
        return
    write_to_log_files(f"teacher placement plan:\n{planned.table}")
    chosen = planned.chosen
    gpu = ", ".join(f"{b / GiB:.1f}" for b in chosen.gpu_bytes)
    gpu = gpu if len(gpu) <= 31 else gpu[:28] + "..."  # eight GPUs' figures: as the table's column cuts them
    peaks = (f"peak GPU {gpu} GiB, " if gpu else "") + f"host {chosen.host_bytes / GiB:.1f} GiB"
    fit = sum(e.fits for e in planned.estimates)
    where = "the table is in train.log, hardware.show_plan=true prints it"
    log.info(
        "teacher placement: %s (%s; %d of %d placements fit here; %s)",
        chosen.placement,
        peaks,
        fit,
        len(planned.estimates),
        where,
    )


def _first_sweep_point(point: dict | None) -> bool:

    return point is not None and HydraConfig.initialized() and HydraConfig.get().job.num == 0


def check_student_room(cfg: DictConfig, student: dict, teacher: dict, hw: Hardware | None = None) -> None:
    """The student fits this machine (weights estimated from its config), and its rope table covers the latent grid."""
    hw = hw or Hardware.detect(cfg.hardware)
    if not is_lora(cfg.student):  # a LoRA student holds adapters, not weights: the planner counts those
        check_student_fits(student, teacher, hw.host_bytes, hw.gpu_bytes)
    check_rope(cfg, student, teacher)


def check_rope(cfg: DictConfig, student: dict, teacher: dict) -> None:
    """The student's and the teacher's rope tables cover the latent grid (a plan checks it too, for any machine)."""
    d, patch = cfg.data, list(student.get("patch_size") or (1, 2, 2))
    who, rope = rope_table(student, teacher)
    other = "" if who == "teacher" else " (or a student with a larger rope_max_seq_len)"
    for (key, size), p in zip(
        (("latent_frames", d.latent_frames), ("latent_height", d.latent_height), ("latent_width", d.latent_width)),
        patch,
    ):
        if size // p > rope:
            raise UserError(
                f"data.{key}={size} is {size // p} patches, more than the {who}'s rope_max_seq_len={rope}; "
                f"use data.{key}<={rope * p}{other}"
            )


def check_data(cfg: DictConfig, spec: TeacherSpec | None = None) -> None:
    """The prompts files, then what the chosen data source checks itself (data.latents=images: its images; with the
    teacher's spec, what needs its VAE: data.latents=videos, its clips' frames and size)."""
    vae = read_json(spec.path / "vae" / "config.json", "teacher.path") if spec is not None else None
    data_sources.check(cfg.data, vae, spec.layout if spec is not None else Layout.t2v)
    if spec is not None and spec.image_encoder and cfg.teacher.max_sequence_length != TEXT_TOKENS:
        raise UserError(
            f"teacher.max_sequence_length={cfg.teacher.max_sequence_length}: teacher={cfg.teacher.name} attends to "
            f"image tokens, which diffusers tells from the text by taking the text as the last {TEXT_TOKENS} tokens; "
            f"use teacher.max_sequence_length={TEXT_TOKENS}"
        )
    if spec is not None:
        data_sources.check_layout(cfg.data, spec.layout, str(cfg.teacher.name))


def choose_placement(
    cfg: DictConfig, precision: Precision, world: World, method
) -> tuple[Placement | None, Plan | None]:
    """The placement to run, `auto` resolved (its config node replaced by the choice's, composed by Hydra);
    one that cannot fit is refused, naming one that can. The plan is None while the teacher's config is
    not on disk yet (a Hub id not downloaded), and so is the placement when `auto` waits for that config.
    `method`: the run's, built (check_training_parts)."""
    auto = getattr(get_class(cfg.teacher_placement._target_), "chosen_by_planner", False)
    placement = None if auto else instantiate(cfg.teacher_placement)
    if placement is not None:
        placement.check(precision, world)
        check_quantize_placement(cfg.teacher.quantize, placement)  # before the planner calls it a misfit
        check_method_placement(cfg, placement, world, method)  # likewise (its estimate for a fake score it cannot hold)
    found = plan.planning_teacher_config(cfg.teacher, cfg.paths.cache_dir)
    if found is None:
        return placement, None
    teacher_config, experts = found
    hw = Hardware.detect(cfg.hardware)
    # the student's size and rope table from its JSON, before the planner builds a meta skeleton of it
    student = check_student(cfg.student, teacher_config)
    check_student_room(cfg, student, teacher_config, hw)
    ranks = plan.ranks_per_node(cfg, hw, world.nproc_per_node)
    passes = method_passes(cfg, method)
    shape = plan.RunShape.of(cfg)
    w = plan.workload(shape, teacher_config, experts, student, precision.teacher_dtype, ranks, passes.networks)
    configured = placement
    estimates = plan.plan(w, hw, configured)
    times = plan.step_times(estimates, w, hw, passes, configured)
    best = plan.choose(estimates, times)
    if best is None and cfg.data.latent_frames > 1:  # a clip too long for this hardware: say how long one fits
        line = advice.largest_frames_line(w, hw, cfg.data.latent_frames, advice.time_factor(cfg.teacher.path))
        if line and not (placement is not None and placement.debug_cpu):
            raise UserError(line)
    if auto:
        placement, best = _resolve_auto(cfg, plan.fastest_first(estimates, times), hw, precision, world)
    assert placement is not None  # named, or chosen by the planner just above
    mine = next(e for e in estimates if e.placement == placement.name)
    if not mine.fits and not placement.debug_cpu:
        # trainer.batch_size=100000000 was told to add memory, where a batch this machine holds would do
        fits_with = advice.fixes(w, hw) if best is None else []
        other = f"use teacher_placement={best.placement}" if best else "no placement fits; add memory"
        other = f"no placement fits as asked; it would with {' or '.join(fits_with)}" if fits_with else other
        raise UserError(
            f"teacher_placement={placement.name} will not fit: it needs {mine.need()} and this machine has "
            f"{hw.describe()}; {other} (python -m wandistiller.plan shows the table)"
        )
    placement.with_plan(mine)
    table = plan.format_table(estimates, hw, placement.name, w, times)
    return placement, Plan(estimates, mine, table, teacher_config, student)


def _resolve_auto(
    cfg: DictConfig, estimates: list[Estimate], hw: Hardware, precision: Precision, world: World
) -> tuple[Placement, Estimate]:
    """The fastest placement that fits and can run with this process layout (`estimates` fastest first:
    planner.fastest_first); `cfg.teacher_placement` becomes its config node, composed by Hydra (its schema,
    defaults and interpolations apply as if it had been named)."""
    on_paper = cfg.hardware.gpus is not None  # planning for other hardware: this machine cannot check it
    for estimate in estimates:
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


def check_combination(cfg: DictConfig, placement: Placement, world: World, method) -> None:
    """Options that each work, but not together (`method`: the run's, built)."""
    teacher_dtype = Precision.from_config(cfg.precision).teacher_dtype
    check_quantize(cfg.teacher.quantize, placement.teacher_device(Topology()), teacher_dtype)
    check_attention_backend(cfg.teacher.get("attention_backend"))
    check_compile_mode(cfg.trainer.compile_mode, cfg.trainer.compile_student)
    if cfg.teacher.compile and not placement.compilable:
        able = ", ".join(names_where(lambda cls: cls.compilable))
        raise UserError(
            f"teacher.compile=true works with the placements that run a whole teacher in one process ({able}), not "
            f"with teacher_placement={placement.name}; drop teacher.compile or pick one of those"
        )
    # The method against the placement (`auto`'s choice too), the loss and the whole-step targets.
    check_method_placement(cfg, placement, world, method)
    check_method_config(cfg, method)
    if cfg.trainer.teacher_whole_step and placement.serving != Serving.LOCAL and world.nproc_per_node > 1:
        local = names_where(lambda cls: cls.serving == Serving.LOCAL)
        raise UserError(
            f"trainer.teacher_whole_step=true batches the targets of a rank's own teacher, and with "
            f"teacher_placement={placement.name} a teacher owner serves them; use {', '.join(local[:-1])} or "
            f"{local[-1]}, or drop trainer.teacher_whole_step"
        )


def check_method_config(cfg: DictConfig, method) -> None:
    """The method against the rest of the config, whatever the placement (`python -m wandistiller.plan` too): the
    loss it would ignore, a data source sampled for nothing, whole-step targets it cannot take."""
    check_method_loss(cfg, method)
    source = data_sources.source_of(cfg.data)
    if source.samples_teacher and not method.reads_x0:
        raise UserError(
            f"data.latents={source.name} samples the teacher's own latents for x0 before training, and "
            f"method={method.name} never reads x0 (the data gives it prompts alone): they would be sampled for "
            "nothing; use data=static_prompts (data.prompts_path: your prompts), data=image_folder or "
            "data=video_folder (captions)"
        )
    if cfg.trainer.teacher_whole_step and method.student_inputs:
        raise UserError(
            f"trainer.teacher_whole_step=true rebuilds a step's inputs from the seed, and method={method.name} calls "
            f"the teacher at the student's own samples; drop trainer.teacher_whole_step"
        )


def check_method_placement(cfg: DictConfig, placement: Placement, world: World, method) -> None:
    """The method, built, against the placement (dmd's teacher-shaped or LoRA fake score): its own line; and a
    LoRA student (student=lora), which backpropagates through the placed teacher whatever the method."""
    if is_lora(cfg.student):
        check_lora_placement(placement, world.size, local_device(Topology()), cfg.teacher)
    method.check(placement, world.size, local_device(Topology()), cfg.teacher)


def check_lora_placement(placement: Placement, ranks: int, device, teacher_cfg) -> None:
    """student=lora backpropagates through the placed teacher on every training rank (placements/base.py)."""
    check_adapters_on_teacher(
        "student=lora", placement, ranks, device, teacher_cfg, "a student of its own (student=half)"
    )


def check_lora_training(cfg: DictConfig, loss: Loss) -> None:
    """What a LoRA student does not take: a compiled student (it is the teacher's own blocks: teacher.compile), and a
    hidden-state loss (its blocks are the teacher's: their outputs would be matched against themselves)."""
    if cfg.trainer.compile_student:
        raise UserError(
            "trainer.compile_student=true with student=lora: the student is the teacher's own blocks with "
            "adapters on, which teacher.compile=true compiles; use that instead of trainer.compile_student"
        )
    if cfg.trainer.gradient_checkpointing:  # the recompute runs after the student's call, its adapters off by then
        raise UserError(
            "trainer.gradient_checkpointing=true with student=lora: the blocks' recomputed forward would run with "
            "the adapters switched off (they are on only inside the student's call); drop "
            "trainer.gradient_checkpointing"
        )
    needs = loss.needs
    if needs.teacher_hidden or needs.student_hidden:
        raise UserError(
            "trainer.loss matches hidden states, and a LoRA student's blocks are the teacher's own; use "
            "loss=distillation (trainer.loss.hidden_kd_weight=0) with student=lora"
        )


def student_identity(cfg: DictConfig) -> dict | None:
    """What a checkpoint records of a LoRA student (LoraStudent.identity); None for another student."""
    if not is_lora(cfg.student):
        return None
    rank, alpha, names = lora_settings(cfg.student)
    return {"builder": "lora", "rank": rank, "alpha": alpha, "layers": list(names)}


def check_method_loss(cfg: DictConfig, method) -> None:
    """A method with its own loss (trajectory, dmd) ignores trainer.loss: one set for it -- another loss than the
    shipped tree's, or a key of that one changed -- is refused, not dropped."""
    if method.uses_loss:
        return
    default = _shipped_loss()
    given = OmegaConf.to_container(cfg.trainer.loss, resolve=False)
    assert isinstance(given, dict)
    if given == default:
        return
    losses = next(r for r in registered() if r.group == "loss")
    name = lambda node: getattr(losses.of_target(str(node.get("_target_"))), "name", node.get("_target_"))
    if given.get("_target_") != default.get("_target_"):
        what = f"loss={name(given)}"
    else:
        key = next(k for k in sorted(set(given) | set(default)) if given.get(k) != default.get(k))
        what = f"trainer.loss.{key}={given.get(key)}"
    raise UserError(
        f"method={method.name} trains with its own loss and ignores trainer.loss, which sets {what}; drop it "
        f"(loss={name(default)} as it ships), or train with method=kd"
    )


@functools.cache  # the shipped tree, composed once a process (a sweep's points, a test worker's runs), only read
def _shipped_loss() -> dict:
    loss = OmegaConf.to_container(compose_config([]).trainer.loss, resolve=False)
    assert isinstance(loss, dict)  # a loss node is a mapping
    return loss


def check_layers(loss: Loss, teacher: dict, student: dict, placement: Placement) -> None:
    """The blocks the loss matches (hidden-state KD): ones both models have (a loss that picks them from the
    depths, loss=features, is resolved on the JSON: the keep-map only moves its pairs among blocks that exist),
    under a placement whose teacher returns hidden states (`loss`: trainer.loss as the run builds it)."""
    resolve = getattr(loss, "resolve", None)
    if resolve is not None:
        resolve(teacher["num_layers"], student["num_layers"])
    needs = loss.needs
    pairs = (
        ("teacher", needs.teacher_hidden, teacher["num_layers"]),
        ("student", needs.student_hidden, student["num_layers"]),
    )
    for name, blocks, depth in pairs:
        bad = next((b for b in blocks if not -depth <= b < depth), None)
        if bad is not None:
            raise UserError(
                f"trainer.loss matches {name} block {bad}, but the {name} has {depth} blocks; match "
                f"blocks in -{depth}..{depth - 1}"
            )
    if needs.teacher_hidden and not placement.hidden_states:
        able = names_where(lambda cls: cls.hidden_states)
        raise UserError(
            f"trainer.loss matches the teacher's hidden states, but teacher_placement={placement.name} returns none; "
            f"use teacher_placement={' or '.join(able[:3])}, or drop hidden-state KD (loss=distillation "
            "trainer.loss.hidden_kd_weight=0)"
        )
