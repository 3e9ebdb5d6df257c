"""The planner: every registered placement's estimate for this teacher, batch and hardware, and the
fastest one that fits. Nothing is loaded, so it also plans on paper for hardware you do not have:

    python -m wandistiller.plan teacher=wan2.2_t2v_a14b hardware.gpus=8 hardware.gpu_memory_gib=40
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from wandistiller.core.arch import KNOWN_TEACHERS
from wandistiller.core.errors import human_count, rate
from wandistiller.placements import Placement, planner_candidates
from wandistiller.placements.memory import (
    FIT_ERROR_PCT,
    Estimate,
    GiB,
    Hardware,
    Workload,
    fake_score_config,
    fake_score_params,
    param_count,
    student_params,
    teacher_weight_bytes,
)
from wandistiller.placements.steptime import CPU_FLOPS, GPU_FLOPS, Passes, StepTime, step_time
from wandistiller.student.model import student_config
from wandistiller.teacher.lora import TARGETS
from wandistiller.teacher.spec import builtin_teacher, read_json
from wandistiller.teacher.tiny import BUILTINS, tiny_transformer


def plan(w: Workload, hw: Hardware, configured: Placement | None = None) -> list[Estimate]:
    """Every candidate's estimate, fastest first; `configured` (the placement asked for, with its own
    settings) stands in for its default-settings twin. With an fp8 teacher a placement that cannot load
    one is refused, and one that fits only because of fp8 says so."""
    return [_estimate(p, w, hw) for p in _candidates(hw, configured)]


def _candidates(hw: Hardware, configured: Placement | None) -> list[Placement]:
    placements = planner_candidates()
    if configured is not None:
        placements = [p for p in placements if p.name != configured.name] + [configured]
    return sorted(placements, key=lambda p: p.speed(hw))


def step_times(
    estimates: list[Estimate], w: Workload, hw: Hardware, passes: Passes, configured: Placement | None = None
) -> dict[str, StepTime]:
    """Each planned placement's step time with the method's passes (placements/steptime.py), by name; the
    placements and `configured` as `plan` took them. Refused placements have none."""
    by_name = {p.name: p for p in _candidates(hw, configured)}
    times = {e.placement: step_time(by_name[e.placement], e, w, hw, passes) for e in estimates}
    return {name: t for name, t in times.items() if t is not None}


def _estimate(p: Placement, w: Workload, hw: Hardware) -> Estimate:
    # A teacher-shaped fake score (method.fake_score=teacher) starts from the teacher on the training device; a
    # LoRA one (lora) backpropagates through the teacher there. (What else they refuse -- served ranks, an fp8
    # teacher -- DMD.check says in its own line, for the placement this chooses.)
    on_training_device = p.on_training_device(hw)
    if w.fake_score == "teacher" and not (p.whole_on_one_device and on_training_device):
        return Estimate.refused(p.name, "keeps the teacher off the training device (method.fake_score=teacher)")
    lora = [
        k for k, on in (("student=lora", w.student_lora_rank), ("method.fake_score=lora", w.fake_score == "lora")) if on
    ]
    if lora and not (p.backprop and on_training_device):
        return Estimate.refused(
            p.name, f"cannot backpropagate through its teacher on the training device ({', '.join(lora)})"
        )
    if not w.teacher_fp8:
        return p.estimate(w, hw)
    if not p.fp8:
        return Estimate.refused(p.name, "cannot load an fp8 teacher (teacher.quantize=fp8)")
    fp8 = p.estimate(w, hw)
    if not (fp8.gpu_bytes or fp8.host_bytes):  # refused for another reason (too few GPUs, ranks)
        return fp8
    note = f"{fp8.note}; fp8 weights"
    if fp8.fits and not p.estimate(dataclasses.replace(w, teacher_fp8=False), hw).fits:
        note += " (fits in fp8 only: bf16 would not)"
    return dataclasses.replace(fp8, note=note)


def fastest_first(estimates: list[Estimate], times: dict[str, StepTime] | None) -> list[Estimate]:
    """The estimates fastest first: by the planner's samples/s per node (step_times) where it has one, to the
    three figures the table prints; the placements' speed order (their order in `estimates`) between equal
    figures and for those without a time, after the timed ones. A fixed order would choose `balanced` (0.54 s/step in
    its own table) over `sharded` (0.07)."""
    times = times or {}

    def key(item: tuple[int, Estimate]) -> tuple[bool, float, int]:
        order, e = item
        t = times.get(e.placement)
        return (t is None, -float(f"{t.samples_per_s:.3g}") if t else 0.0, order)

    return [e for _, e in sorted(enumerate(estimates), key=key)]


def choose(estimates: list[Estimate], times: dict[str, StepTime] | None = None) -> Estimate | None:
    """`auto`'s choice: the fastest placement that fits (fastest_first)."""
    return next((e for e in fastest_first(estimates, times) if e.fits), None)


# The shapes the model was fitted on (docs/planner_fit.json); a figure beyond them is marked extrapolated.
FITTED_STUDENTS = {(32, 64), (1536, 4096)}  # (width, ffn_dim)
FITTED_CPU_TOKENS = (16384, 32768)  # image and text tokens per step, host RSS with the student on the CPU
FITTED_GPU: dict[str, Any] = {"placements": {"gpu"}, "teacher_width": 1536, "tokens": 16 * 1560}  # the H200 datum


def extrapolated(w: Workload, hw: Hardware, placement: str) -> bool:
    """Whether this placement's figures lie beyond the shapes and placements the model was fitted on."""
    c, teacher = w.student_config, w.teacher_config
    if (c["num_attention_heads"] * c["attention_head_dim"], c["ffn_dim"]) not in FITTED_STUDENTS:
        return True
    if hw.gpu_bytes:  # one GPU datum: a resident 1.3B-shaped teacher, b16 x 1560 tokens
        width = teacher["num_attention_heads"] * teacher["attention_head_dim"]
        too_big = width > FITTED_GPU["teacher_width"] or w.batch_size * w.tokens > FITTED_GPU["tokens"]
        return too_big or placement not in FITTED_GPU["placements"] or w.ranks_per_node > 1
    tokens = (w.batch_size * w.tokens, (w.teacher_batch_size or w.batch_size) * w.text_tokens)
    return any(n > limit for n, limit in zip(tokens, FITTED_CPU_TOKENS)) or teacher["num_layers"] > 4


def format_table(
    estimates: list[Estimate],
    hw: Hardware,
    chosen: str | None = None,
    w: Workload | None = None,
    times: dict[str, StepTime] | None = None,
) -> str:
    """The plan's table: each placement's fit and peaks, and with `times` its step time and samples/s per node."""
    rows = [
        f"hardware: {hw.describe()}; {hw.describe_headroom()}",
        f"predictions: 0 to +{FIT_ERROR_PCT}% over the measured peaks where fitted (docs/PLANNER.md); "
        "* = extrapolated beyond the fitted shapes",
    ]
    if times is not None:
        rows.append(
            f"s/step, samples/s per node: rough (placements/steptime.py): FLOPs at {GPU_FLOPS / 1e12:.0f} TFLOP/s "
            f"per GPU (an H200's, fitted) or {CPU_FLOPS / 1e9:.0f} GFLOP/s on the CPU, streamed copies overlapped; "
            "auto takes the fastest that fits by these samples/s"
        )
    speed = f"{'s/step':>7} {'samples/s':>9} " if times is not None else ""
    rows.append(f"{'placement':<11} {'fits':<5} {'peak GPU GiB (per device)':<34} host GiB  {speed}note")
    for e in estimates:
        planned = bool(e.gpu_bytes or e.host_bytes)
        star = "*" if w is not None and planned and extrapolated(w, hw, e.placement) else ""
        gpu = ", ".join(f"{b / GiB:.1f}" for b in e.gpu_bytes) or "-"
        gpu = (gpu if len(gpu) <= 31 else gpu[:28] + "...") + (star if e.gpu_bytes else "")
        host = f"{e.host_bytes / GiB:.1f}" + ("*" if star or (planned and hw.gpu_bytes) else "")  # HOST_CUDA
        mark = " <- chosen" if e.placement == chosen else ""
        why = f" (headroom: {e.headroom_excludes})" if e.headroom_excludes else shortfall(e, hw)
        t = (times or {}).get(e.placement)
        speed = "" if times is None else f"{rate(t.seconds) if t else '-':>7} {rate(t.samples_per_s) if t else '-':>9} "
        rows.append(f"{e.placement:<11} {'yes' if e.fits else 'no':<5} {gpu:<34} {host:<9} {speed}{e.note}{why}{mark}")
    return "\n".join(rows)


def shortfall(e: Estimate, hw: Hardware) -> str:
    """A "no" row's reason in numbers: which device is short and by how much (after its headroom). Rows
    refused for another reason (no GPU, too few ranks) already say so in their note."""
    if e.fits or not (e.gpu_bytes or e.host_bytes):
        return ""
    short = shortages(e, hw)
    if not short:
        return ""
    d, missing, usable = max(short, key=lambda s: s[1])
    more = f"; {len(short) - 1} more device(s) short too" if len(short) > 1 else ""
    return f" (short of {missing / GiB:.1f} GiB on {d}, {usable / GiB:.1f} usable{more})"


def shortages(e: Estimate, hw: Hardware) -> list[tuple[str, int, int]]:
    """(device, bytes missing, bytes usable) of each device an estimate needs more of than it has after headroom."""
    devices = [(f"GPU {i}", need, cap) for i, (need, cap) in enumerate(zip(e.gpu_bytes, hw.gpu_bytes))]
    devices.append(("host RAM", e.host_bytes, hw.host_bytes))
    return [(d, need - hw.usable(cap), hw.usable(cap)) for d, need, cap in devices if need > hw.usable(cap)]


def planning_teacher_config(teacher_cfg, cache_dir) -> tuple[dict, int] | None:
    """(transformer config, experts) from a local folder's JSON or the known public teachers; None if neither."""
    path = Path(str(teacher_cfg.path)).expanduser()
    if (path / "transformer" / "config.json").is_file():
        try:
            index = json.loads((path / "model_index.json").read_text())
            config = json.loads((path / "transformer" / "config.json").read_text())
        except (OSError, ValueError):
            return None  # not readable as a Wan folder: inspect_teacher names what is wrong
        if not isinstance(index, dict) or not isinstance(config, dict):
            return None
        experts = 2 if (index.get("transformer_2") or [None])[-1] else 1
        return config, experts
    builtin = builtin_teacher(teacher_cfg, cache_dir)
    if builtin is not None:
        built = BUILTINS[builtin]
        return tiny_transformer(**built), 2 if built.get("two_experts") else 1
    return KNOWN_TEACHERS.get(str(teacher_cfg.path))


# Wan's text encoder, umT5-XXL's encoder (every public Wan teacher's): ~5.7B parameters, ~10.6 GiB in bf16.
UMT5_XXL_PARAMS = 5_680_000_000


def text_encoder_bytes(teacher_cfg, dtype_bytes: int) -> int | None:
    """The host memory of the teacher's text encoder, which a first run loads to encode its prompts (then cached):
    from a local folder's text_encoder/config.json (a T5 encoder's parameters), umT5-XXL for the public teachers;
    None where neither says."""
    path = Path(str(teacher_cfg.path)).expanduser()
    if (path / "text_encoder" / "config.json").is_file():
        try:
            c = json.loads((path / "text_encoder" / "config.json").read_text())
            d, ff, layers, vocab = (int(c[k]) for k in ("d_model", "d_ff", "num_layers", "vocab_size"))
            inner = int(c.get("num_heads", 1)) * int(c.get("d_kv", d))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        gated = str(c.get("feed_forward_proj", "")).startswith("gated")
        params = vocab * d + layers * (4 * d * inner + (3 if gated else 2) * d * ff + 2 * d) + d
    elif str(teacher_cfg.path) in KNOWN_TEACHERS:
        params = UMT5_XXL_PARAMS
    else:
        return None
    return params * dtype_bytes


def text_encoder_line(nbytes: int | None, hw: Hardware) -> str | None:
    """The plan's line for the first run's text-encoder pass, and what to do where the host cannot hold it."""
    if nbytes is None:
        return None
    line = (
        f"text encoder: {nbytes / GiB:.1f} GiB of host RAM while a first run encodes its prompts (once; cached in "
        "paths.cache_dir), before the teacher is placed"
    )
    usable = hw.usable(hw.host_bytes)
    if nbytes > usable:
        line += (
            f"; more than this host's {usable / GiB:.1f} GiB usable: encode them once on a machine with more RAM "
            "into the same paths.cache_dir (or plan with hardware.host_memory_gib=<GiB> for the machine you mean)"
        )
    return line


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What the planner reads of a run besides the two models' configs, as typed values (`RunShape.of` takes them
    from a composed config): the batch and latent grid, the trainer's memory switches, the student's adapters
    (student=lora), the method's own network (dmd's fake score)."""

    batch_size: int  # per rank, per micro-batch
    latent_grid: tuple[int, int, int]  # data.latent_frames, latent_height, latent_width
    text_tokens: int
    gradient_checkpointing: bool
    ema: bool
    teacher_batch_size: int  # samples per teacher call (a whole step's under trainer.teacher_whole_step)
    autocast: bool
    compiled: bool
    teacher_fp8: bool
    student_lora_rank: int  # student=lora's rank; 0: a student network of its own
    student_lora_layers: tuple[str, ...] | None
    fake_score: str | None
    fake_updates: int
    lora_rank: int

    @classmethod
    def of(cls, cfg) -> RunShape:
        d, t = cfg.data, cfg.trainer
        method = cfg.get("method") or {}  # a method that trains a fake score beside the student (dmd) names its shape
        # student=lora (builder lora, rank r): the placed teacher with adapters, shaped as the teacher
        lora_student = cfg.student.get("builder") == "lora"
        return cls(
            batch_size=t.batch_size,
            latent_grid=(d.latent_frames, d.latent_height, d.latent_width),
            text_tokens=cfg.teacher.max_sequence_length,
            gradient_checkpointing=t.gradient_checkpointing,
            ema=t.ema_decay is not None,
            teacher_batch_size=t.batch_size * (t.grad_accum_steps if t.teacher_whole_step else 1),
            autocast=cfg.precision.autocast_dtype is not None,
            compiled=t.compile_student,
            teacher_fp8=cfg.teacher.quantize == "fp8",
            student_lora_rank=int(cfg.student.rank) if lora_student else 0,
            student_lora_layers=lora_layers(cfg.student.get("layers")) if lora_student else None,
            fake_score=method.get("fake_score"),
            fake_updates=method.get("fake_updates") or 0,
            lora_rank=method.get("lora_rank") or 0,
        )


def workload(
    shape: RunShape, teacher_config: dict, experts: int, student: dict, teacher_dtype: torch.dtype, ranks: int
) -> Workload:
    """The planner's inputs for a run of this shape: `student` is the student's config (student.model's
    check_student against `teacher_config`); a LoRA student (student=lora) is planned as the teacher itself."""
    pt, ph, pw = teacher_config.get("patch_size", [1, 2, 2])
    frames, height, width = shape.latent_grid
    return Workload(
        teacher_config=teacher_config,
        experts=experts,
        teacher_dtype_bytes=torch.finfo(teacher_dtype).bits // 8,
        student_config=dict(teacher_config) if shape.student_lora_rank else student,
        student_lora_rank=shape.student_lora_rank,
        student_lora_layers=shape.student_lora_layers,
        batch_size=shape.batch_size,
        tokens=(frames // pt) * (height // ph) * (width // pw),
        text_tokens=shape.text_tokens,
        gradient_checkpointing=shape.gradient_checkpointing,
        ema=shape.ema,
        ranks_per_node=ranks,
        teacher_batch_size=shape.teacher_batch_size,
        autocast=shape.autocast,
        compiled=shape.compiled,
        teacher_fp8=shape.teacher_fp8,
        fake_score=shape.fake_score,
        fake_updates=shape.fake_updates,
        lora_rank=shape.lora_rank,
    )


def lora_layers(layers) -> tuple[str, ...] | None:
    """A LoRA student's `student.layers` as Linear names in a block: all (None), attention, ffn, or a list."""
    if layers is None or layers == "all":
        return None
    if layers in ("attention", "ffn"):
        return tuple(n for n in TARGETS if n.startswith("attn" if layers == "attention" else "ffn"))
    return tuple(str(n) for n in layers)


def workload_of(
    cfg, teacher_dtype: torch.dtype, launched: int = 1, ranks: int | None = None, hw: Hardware | None = None
) -> tuple[Workload, Hardware] | None:
    """The one way from a composed config to the planner's inputs: (Workload, Hardware), the hardware detected
    (or as `hardware.*` describes it on paper), the ranks per node as the run will have them (`ranks` fixes
    them). None while the teacher's config is not on disk (a Hub id not downloaded)."""
    found = planning_teacher_config(cfg.teacher, cfg.paths.cache_dir)
    if found is None:
        return None
    teacher_config, experts = found
    hw = hw or Hardware.detect(cfg.hardware)
    lora_student = cfg.student.get("builder") == "lora"  # planned as the teacher: its config is not read
    student = dict(teacher_config) if lora_student else student_config(cfg.student, teacher_config)
    ranks = ranks or ranks_per_node(cfg, hw, launched)
    return workload(RunShape.of(cfg), teacher_config, experts, student, teacher_dtype, ranks), hw


def ranks_per_node(cfg, hw: Hardware, launched: int = 1) -> int:
    """The ranks per node: configured or started by torchrun (`launched`); on paper, one rank per GPU."""
    ranks = max(cfg.distributed.nproc_per_node, launched)
    if ranks > 1:
        return ranks
    return max(len(hw.gpu_bytes), 1) if cfg.hardware.gpus is not None else 1


def plan_report(
    w: Workload,
    hw: Hardware,
    teacher: str,
    passes: Passes,
    precision: str = "",
    configured: Placement | None = None,
    clip: tuple[int, int] | None = None,
    text_encoder: int | None = None,
) -> str:
    """The plan's text: the workload (`teacher`: its name), the method's own network and passes (`passes`: the built
    method's), each placement's estimate and step time, and `auto`'s choice. `precision`: the line saying which
    precision the figures are at (and why, for precision=auto). `configured`: the placement asked for, planned
    with its own settings (e.g. `teacher_placement.resident_blocks=0`), as `plan` takes it. `clip`: (latent
    frames, the VAE's time factor) of a clip run, which adds the line of the largest latent_frames that fits."""
    estimates = plan(w, hw, configured)
    times = step_times(estimates, w, hw, passes, configured)
    best = choose(estimates, times)
    head = (
        f"teacher {teacher}: {w.experts} expert(s), {teacher_weight_bytes(w) / GiB:.1f} GiB of weights; "
        f"student {describe_student(w)}; batch {w.batch_size} x {w.tokens} tokens"
    )
    tail = f"auto would choose: {best.placement}" if best else "nothing fits: use smaller dtypes or more memory"
    table = format_table(estimates, hw, best.placement if best else None, w, times)
    fix = fixes_line(w, hw, configured)
    frames = [frames_line(w, hw, *clip, configured)] if clip and clip[0] > 1 else []
    encoder = text_encoder_line(text_encoder, hw)
    lines = [head, *method_lines(w, passes), *([precision] if precision else []), table, *fix]
    return "\n".join([*lines, *([encoder] if encoder else []), tail, *frames])


def _fits(w: Workload, hw: Hardware, configured: Placement | None) -> bool:
    """Whether the asked run fits: under `configured` (with its settings), or under any placement (auto)."""
    estimates = plan(w, hw, configured)
    return any(e.fits for e in estimates if configured is None or e.placement == configured.name)


def fixes(w: Workload, hw: Hardware, configured: Placement | None = None) -> list[str]:
    """For a run that does not fit (under `configured`, or any placement where it is None): the overrides that
    each alone would make it fit, the largest setting first: fewer resident blocks (a placement given a count),
    a smaller trainer.batch_size, teacher.quantize=fp8. Fewer frames is `frames_line`'s.
    Empty where it fits, or where `configured` is refused outright (its note says why)."""
    if _fits(w, hw, configured):
        return []
    if configured is not None:
        mine = next(e for e in plan(w, hw, configured) if e.placement == configured.name)
        if not (mine.gpu_bytes or mine.host_bytes):
            return []
    found = []
    asked = getattr(configured, "resident_blocks", "auto")
    if asked != "auto" and int(asked) > 0:
        fewer = copy.copy(configured)
        for k in range(int(asked) - 1, -1, -1):
            fewer.resident_blocks = k  # type: ignore[union-attr]
            if _fits(w, hw, fewer):
                found.append(f"teacher_placement.resident_blocks={k}")
                break
    smaller = next((b for b in range(w.batch_size - 1, 0, -1) if _fits(_at_batch(w, b), hw, configured)), None)
    if smaller:
        found.append(f"trainer.batch_size={smaller}")
    if not w.teacher_fp8 and _fits(dataclasses.replace(w, teacher_fp8=True), hw, configured):
        found.append("teacher.quantize=fp8")
    if found:
        return found
    together, least = [], w  # no one of them alone: all of them at once
    if asked != "auto" and int(asked) > 0:
        configured = copy.copy(configured)
        configured.resident_blocks, together = 0, ["teacher_placement.resident_blocks=0"]  # type: ignore[union-attr]
    if w.batch_size > 1:
        least, together = _at_batch(least, 1), [*together, "trainer.batch_size=1"]
    if not w.teacher_fp8:
        least, together = dataclasses.replace(least, teacher_fp8=True), [*together, "teacher.quantize=fp8"]
    return [" ".join(together)] if len(together) > 1 and _fits(least, hw, configured) else []


def _at_batch(w: Workload, batch: int) -> Workload:
    """`w` at another per-rank batch (a teacher call's batch scaled with it)."""
    teacher = (w.teacher_batch_size or w.batch_size) * batch // w.batch_size
    return dataclasses.replace(w, batch_size=batch, teacher_batch_size=max(teacher, batch))


def fixes_line(w: Workload, hw: Hardware, configured: Placement | None = None) -> list[str]:
    """The plan's line naming what would make a run that does not fit, fit (none where nothing of that does)."""
    found = fixes(w, hw, configured)
    where = f"teacher_placement={configured.name}" if configured is not None else "this run"
    if not found:
        return []
    if " " in found[0]:  # overrides that fit only together
        return [f"{where} would fit with all of: {found[0]}"]
    return [f"{where} would fit with any one of: {', or '.join(found)}"]


def nothing_fits(w: Workload, hw: Hardware, frames: int) -> str | None:
    """Where no setting fits this hardware -- under any placement, at batch 1, one latent frame, and an fp8 teacher
    (offload/disk then keep only the blocks that fit) -- what is short and by how much, from
    the placement short of least; None where some setting fits."""
    least = dataclasses.replace(_at_frames(_at_batch(w, 1), frames, 1), teacher_fp8=True)
    estimates = [e for e in plan(least, hw) if e.gpu_bytes or e.host_bytes]
    if any(e.fits for e in estimates) or not estimates:
        return None
    short = {e.placement: shortages(e, hw) for e in estimates}
    name = min(short, key=lambda n: sum(m for _, m, _ in short[n]))
    missing = " and ".join(f"{m / GiB:.1f} GiB of {d} ({u / GiB:.1f} usable)" for d, m, u in short[name])
    return (
        f"no setting fits {hw.describe()}, not even trainer.batch_size=1 data.latent_frames=1"
        + (" teacher.quantize=fp8" if least.teacher_fp8 else "")
        + f": the closest, teacher_placement={name}, is short of {missing}; use a GPU or host with that much more"
        " memory"
    )


MOST_FRAMES = 1024  # latent frames searched at most (job/checks.py's MAX_LATENT): Wan's rope table covers 1024


def _at_frames(w: Workload, frames: int, f: int) -> Workload:
    """`w` (`w.tokens` are `frames` latent frames' worth) at `f` latent frames, the same height and width."""
    pt = int((w.teacher_config.get("patch_size") or [1, 2, 2])[0])
    per_step = max(w.tokens // max(frames // pt, 1), 1)  # tokens per patch of time (one latent frame for Wan)
    return dataclasses.replace(w, tokens=max(f // pt, 1) * per_step)


def largest_frames(
    w: Workload, hw: Hardware, frames: int, configured: Placement | None = None, most: int = MOST_FRAMES
) -> int:
    """The most latent frames a run of `w`'s shape fits at its height and width (`w.tokens` are `frames`' worth):
    under `configured`, or any placement where it is None (auto); 0 where not even one frame fits. Memory grows
    with tokens, so a bisection finds it."""

    def fits(f: int) -> bool:
        estimates = plan(_at_frames(w, frames, f), hw, configured)
        return any(e.fits for e in estimates if configured is None or e.placement == configured.name)

    if fits(most):
        return most
    low, high = 0, most - 1  # fits(low) (0: nothing yet); not fits(high + 1)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def time_factor(teacher_path: str) -> int:
    """Frames per latent frame of the teacher's VAE (its vae/config.json's scale_factor_temporal), or Wan's 4 for
    a teacher not on disk (a Hub id planned on paper: every Wan 2.1/2.2 VAE compresses time 4x)."""
    config = Path(str(teacher_path)).expanduser() / "vae" / "config.json"
    return int(read_json(config, "teacher.path").get("scale_factor_temporal", 4)) if config.is_file() else 4


def largest_frames_line(w: Workload, hw: Hardware, frames: int, time_factor: int) -> str | None:
    """A train refusal's words for a clip that fits no placement here: the largest latent_frames that does
    (None where not even one frame fits: the usual refusal then says what to do)."""
    n = largest_frames(w, hw, frames)
    if n == 0 or n >= frames:
        return None
    return (
        f"data.latent_frames={frames} is more frames than fit ({hw.describe()}): the largest latent_frames that "
        f"fits: {n} (= {(n - 1) * time_factor + 1} frames) at batch {w.batch_size} and this frame size; use "
        f"data.latent_frames<={n}, a smaller trainer.batch_size or more memory (python -m wandistiller.plan)"
    )


def frames_line(w: Workload, hw: Hardware, frames: int, time_factor: int, configured: Placement | None = None) -> str:
    """The plan's line for a clip (`frames` latent frames > 1): the largest latent_frames that fits on this hardware
    (and under `configured`, the placement asked for, where that is less), in frames of the VAE's."""
    n = largest_frames(w, hw, frames)
    if n == 0:
        return "the largest latent_frames that fits: none (not even 1 latent frame fits this hardware)"
    fitting = [e.placement for e in plan(_at_frames(w, frames, n), hw, configured) if e.fits]
    verdict = "fits" if n >= frames else f"does not: use data.latent_frames<={n}"
    line = (
        f"the largest latent_frames that fits: {n} (= {(n - 1) * time_factor + 1} frames) at batch {w.batch_size} "
        f"and this frame size ({', '.join(fitting)}); data.latent_frames={frames} {verdict}"
    )
    if configured is not None and configured.name not in fitting:
        mine = largest_frames(w, hw, frames, configured)
        line += f"; teacher_placement={configured.name}: " + (f"at most {mine}" if mine else "not even 1")
    return line


def describe_student(w: Workload) -> str:
    """The student in the plan's head: its network's parameters, or a LoRA student's adapters (student=lora)."""
    if not w.student_lora_rank:
        return f"{human_count(param_count(w.student_config))} params"
    return (
        f"LoRA of rank {w.student_lora_rank} on the teacher's {w.experts} expert(s), "
        f"{human_count(student_params(w))} adapter params (no weights of its own; a backward through the teacher, "
        f"checkpointed per block where it streams)"
    )


def method_lines(w: Workload, passes: Passes) -> list[str]:
    """What the plan counts of the method: its own network's memory (dmd's fake score), and the passes of a step
    that its step times count (the fake score's and few-step generations' on the training rank, under every
    placement)."""
    config = fake_score_config(w)
    if config is not None and w.fake_score == "lora":
        return [
            f"fake score (LoRA of rank {w.lora_rank} on the teacher's {w.experts} expert(s), "
            f"{human_count(fake_score_params(w))} adapter params): their weights, AdamW states and grads, and the "
            f"activations of a teacher-sized backward (checkpointed per block where the teacher streams: offload, "
            f"disk), counted on every training rank",
            passes.describe(),
        ]
    lines = (
        []
        if config is None
        else [
            f"fake score ({w.fake_score}-shaped, {human_count(param_count(config))} params): its weights, AdamW states "
            f"and grads counted on every training rank"
        ]
    )
    return [*lines, passes.describe()]
