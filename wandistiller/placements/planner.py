"""The planner: every registered placement's estimate for this teacher, batch and hardware, and the
fastest one that fits. Nothing is loaded, so it also plans on paper for hardware you do not have:

    python -m wandistiller.plan teacher=wan2.2_t2v_a14b hardware.gpus=8 hardware.gpu_memory_gib=40
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from wandistiller.core.arch import KNOWN_TEACHERS
from wandistiller.core.errors import human_count, rate
from wandistiller.placements import Placement, planner_candidates
from wandistiller.placements.memory import (
    ADAPTERS,
    FIT_ERROR_PCT,
    TEACHER_SHAPED,
    Estimate,
    GiB,
    Hardware,
    OwnNetwork,
    Workload,
    adapted,
    network_params,
    param_count,
    student_params,
)
from wandistiller.placements.steptime import CPU_FLOPS, GPU_FLOPS, Passes, StepTime, step_time
from wandistiller.student.lora import is_lora
from wandistiller.student.model import student_config
from wandistiller.teacher.lora import TARGETS
from wandistiller.teacher.spec import builtin_teacher
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
    # A method's teacher-shaped network (method.fake_score=teacher) starts from the teacher on the training device;
    # adapters on the teacher (student=lora, method.fake_score=lora) backpropagate through it there. (What else they
    # refuse -- served ranks, an fp8 teacher -- the method's and student's own checks say, for the chosen placement.)
    on_training_device = p.on_training_device(hw)
    shaped = [n.key for n in w.networks if n.shape == TEACHER_SHAPED]
    if shaped and not (p.whole_on_one_device and on_training_device):
        return Estimate.refused(p.name, f"keeps the teacher off the training device ({', '.join(shaped)})")
    lora = ["student=lora"] if w.student_lora_rank else []
    lora += [n.key for n in w.networks if n.shape == ADAPTERS]
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
# Adapters on the placed teacher (a LoRA student), batch 1 x 1560 tokens on one GPU: (teacher width, placement) as
# measured, the 1.3B resident (an H100 and an H200) and the 14B streamed by offload, bf16 and fp8 (an H200).
MEASURED_ADAPTED = {(1536, "gpu"), (5120, "offload")}


def extrapolated(w: Workload, hw: Hardware, placement: str) -> bool:
    """Whether this placement's figures lie beyond the shapes and placements the model was fitted on."""
    c, teacher = w.student_config, w.teacher_config
    if hw.gpu_bytes and w.student_lora_rank:
        width = teacher["num_attention_heads"] * teacher["attention_head_dim"]
        measured = (width, placement) in MEASURED_ADAPTED and w.batch_size * w.tokens <= 1560
        return not measured or w.ranks_per_node > 1
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
    asked: str | None = None,
) -> str:
    """The plan's table: each placement's fit and peaks, and with `times` its step time and samples/s per node.
    `chosen` is marked; `asked` (plan's teacher_placement, where `chosen` is auto's) as the run's, so the row auto
    would take is not read as the one the run takes."""
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
        mark = _mark(e.placement, chosen, asked)
        why = f" (headroom: {e.headroom_excludes})" if e.headroom_excludes else shortfall(e, hw)
        t = (times or {}).get(e.placement)
        speed = "" if times is None else f"{rate(t.seconds) if t else '-':>7} {rate(t.samples_per_s) if t else '-':>9} "
        rows.append(f"{e.placement:<11} {'yes' if e.fits else 'no':<5} {gpu:<34} {host:<9} {speed}{e.note}{why}{mark}")
    return "\n".join(rows)


def _mark(placement: str, chosen: str | None, asked: str | None) -> str:
    """A row's mark: the run's placement (`asked`), auto's choice (`chosen`), or both; `chosen` alone: chosen."""
    if asked is None:
        return " <- chosen" if placement == chosen else ""
    if placement == asked:
        return " <- the run's (auto's too)" if placement == chosen else " <- the run's"
    return " <- auto would choose" if placement == chosen else ""


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
    (student=lora). The method's own networks are its declaration (`Method.passes`), not read from its keys."""

    batch_size: int  # per rank, per micro-batch
    latent_grid: tuple[int, int, int]  # data.latent_frames, latent_height, latent_width
    text_tokens: int
    gradient_checkpointing: bool
    ema: bool
    teacher_batch_size: int  # samples per teacher call (a whole step's under trainer.teacher_whole_step)
    autocast: bool
    compiled: bool
    teacher_compiled: bool
    teacher_fp8: bool
    student_lora_rank: int  # student=lora's rank; 0: a student network of its own
    student_lora_layers: tuple[str, ...] | None

    @classmethod
    def of(cls, cfg) -> RunShape:
        d, t = cfg.data, cfg.trainer
        lora_student = is_lora(cfg.student)  # the placed teacher with adapters of rank r, shaped as the teacher
        return cls(
            batch_size=t.batch_size,
            latent_grid=(d.latent_frames, d.latent_height, d.latent_width),
            text_tokens=cfg.teacher.max_sequence_length,
            gradient_checkpointing=t.gradient_checkpointing,
            ema=t.ema_decay is not None,
            teacher_batch_size=t.batch_size * (t.grad_accum_steps if t.teacher_whole_step else 1),
            autocast=cfg.precision.autocast_dtype is not None,
            compiled=t.compile_student,
            teacher_compiled=bool(cfg.teacher.get("compile", False)),
            teacher_fp8=cfg.teacher.quantize == "fp8",
            student_lora_rank=int(cfg.student.rank) if lora_student else 0,
            student_lora_layers=lora_layers(cfg.student.get("layers")) if lora_student else None,
        )


def workload(
    shape: RunShape,
    teacher_config: dict,
    experts: int,
    student: dict,
    teacher_dtype: torch.dtype,
    ranks: int,
    networks: tuple[OwnNetwork, ...],
) -> Workload:
    """The planner's inputs for a run of this shape: `student` is the student's config (student.model's
    check_student against `teacher_config`); a LoRA student (student=lora) is planned as the teacher itself.
    `networks`: the method's own, as it declares them (`Method.passes(...).networks`)."""
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
        teacher_compiled=shape.teacher_compiled,
        teacher_fp8=shape.teacher_fp8,
        networks=networks,
    )


def lora_layers(layers) -> tuple[str, ...] | None:
    """A LoRA student's `student.layers` as Linear names in a block: all (None), attention, ffn, or a list."""
    if layers is None or layers == "all":
        return None
    if layers in ("attention", "ffn"):
        return tuple(n for n in TARGETS if n.startswith("attn" if layers == "attention" else "ffn"))
    return tuple(str(n) for n in layers)


def workload_of(
    cfg,
    teacher_dtype: torch.dtype,
    networks: tuple[OwnNetwork, ...],
    launched: int = 1,
    ranks: int | None = None,
    hw: Hardware | None = None,
    teacher: tuple[dict, int] | None = None,
) -> tuple[Workload, Hardware] | None:
    """The one way from a composed config to the planner's inputs: (Workload, Hardware), the hardware detected
    (or as `hardware.*` describes it on paper), the ranks per node as the run will have them (`ranks` fixes
    them); `networks`: the method's own (`Method.passes(...).networks`); `teacher`: its (transformer config,
    experts) where the caller has read its folder already, else read here. None while the teacher's config is not
    on disk (a Hub id not downloaded)."""
    found = teacher or planning_teacher_config(cfg.teacher, cfg.paths.cache_dir)
    if found is None:
        return None
    teacher_config, experts = found
    hw = hw or Hardware.detect(cfg.hardware)
    # a LoRA student is planned as the teacher: its config is not read
    student = dict(teacher_config) if is_lora(cfg.student) else student_config(cfg.student, teacher_config)
    ranks = ranks or ranks_per_node(cfg, hw, launched)
    return workload(RunShape.of(cfg), teacher_config, experts, student, teacher_dtype, ranks, networks), hw


def ranks_per_node(cfg, hw: Hardware, launched: int = 1) -> int:
    """The ranks per node: configured or started by torchrun (`launched`); on paper, one rank per GPU."""
    ranks = max(cfg.distributed.nproc_per_node, launched)
    if ranks > 1:
        return ranks
    return max(len(hw.gpu_bytes), 1) if cfg.hardware.gpus is not None else 1


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
    """What the plan counts of the method: each network of its own (dmd's fake score) in memory, and the passes of
    a step that its step times count (its networks' and few-step generations' on the training rank, under every
    placement)."""
    lines = []
    for n in w.networks:
        params = human_count(network_params(w, n))
        if adapted(w, n):
            rank = n.rank if n.shape == ADAPTERS else w.student_lora_rank
            lines.append(
                f"{n.name} ({n.key}: LoRA of rank {rank} on the teacher's {w.experts} expert(s), {params} adapter "
                f"params): their weights, optimizer states and grads, and the activations of a teacher-sized backward "
                f"(checkpointed per block where the teacher streams: offload, disk), counted on every training rank"
            )
        else:
            lines.append(
                f"{n.name} ({n.key}: {n.shape}-shaped, {params} params): its weights, optimizer states and grads "
                f"counted on every training rank"
            )
    return [*lines, passes.describe()]
