"""What every export format shares: its record (`ExportFormat`: its name, dtypes and default dtype, which runs it
takes, its writer), what the command line asks of it (`Request`), and the facts of the run its files state (the
student, its sampling, its teacher, how its ComfyUI workflow samples). A format is one module of this package that
declares `FORMAT = ExportFormat(...)`; `formats()` finds them, and `python -m wandistiller.export` is a loop over
them: adding a format is its module and its record."""

from __future__ import annotations

import importlib
import logging
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from wandistiller.core.errors import UserError
from wandistiller.core.files import in_run
from wandistiller.state.card import card_teacher, example_prompt, model_card, saved_prompts
from wandistiller.state.checkpoint import list_checkpoints
from wandistiller.state.comfy import (
    IMAGE_NODES,
    MANUAL,
    VAE,
    VAE_22,
    WORKFLOWS,
    Sampling,
    default_workflow,
    workflow_problem,
)
from wandistiller.state.runs import load_student, recorded_teacher, student_source
from wandistiller.state.sampling import image_scale, time_scale
from wandistiller.state.saved import raw_value, saved_number, saved_word
from wandistiller.student.lora import BUILDER as LORA_BUILDER
from wandistiller.teacher.fewstep import student_schedule
from wandistiller.teacher.spec import pipeline_name

log = logging.getLogger("wandistiller.export")

DTYPES = ("bf16", "fp16", "fp32", "fp8")
DTYPE_WORDS = {"fp8": "ComfyUI's fp8"}  # what a dtype only some formats take is, in their refusal


@dataclass(frozen=True)
class Request:
    """What the command line asks of a writer."""

    checkpoint: str | None = None  # best, latest, step_N or ema; None: the final student
    dtype: str | None = None  # the format's default where None was asked (None again: as the student was saved)
    name: str | None = None  # the files' name; None: the format's own from the teacher and the student
    fp8_layout: str = "comfy_quant"  # --dtype fp8's layout (state/singlefile.py FP8_LAYOUTS)
    workflow: str | None = None  # the ComfyUI workflow's kind (state/comfy.py WORKFLOWS); None: the teacher's own
    phrases: Mapping[str, str] = field(default_factory=dict)  # what each method taught its student (the card's)


@dataclass(frozen=True)
class ExportFormat:
    """One `--format`: its name, the dtypes it writes (the first of them or None its default), whether it writes a
    ComfyUI workflow, why it cannot export a run (one line; None: it can), and its writer: the run's files into a
    temporary folder, returning the folder that then takes --out's place."""

    name: str
    dtypes: tuple[str, ...]
    default_dtype: str | None  # None: as the student was saved
    takes: str  # the dtypes in words, for the refusal of another one
    workflow: bool  # it writes a ComfyUI workflow (--workflow picks its kind)
    refusal: Callable[[Any], str | None]
    write: Callable[[Any, Path, Request], Path]
    # What must be at hand before any work, checked last, after the command line's own checks (a LoRA student's
    # merged single file: its teacher's weights); it raises its one line.
    ready: Callable[[Any], None] = lambda run: None
    order: int = 100  # where it is listed (--format's choices, the help, the refusals): lowest first
    named: bool = True  # its files take --name (a diffusers folder's are diffusers' own)


def formats() -> dict[str, ExportFormat]:
    """Every format of this package (a module declaring `FORMAT`), by name, in `order` (then name)."""
    package = importlib.import_module(__name__.rsplit(".", 1)[0])
    found: list[ExportFormat] = []
    for module in pkgutil.iter_modules(package.__path__):
        record = getattr(importlib.import_module(f"{package.__name__}.{module.name}"), "FORMAT", None)
        if isinstance(record, ExportFormat):
            found.append(record)
    return {f.name: f for f in sorted(found, key=lambda f: (f.order, f.name))}


def dtype_refusal(fmt: ExportFormat, dtype: str) -> str | None:
    """One line where `fmt` does not write `dtype`: which formats do, and what this one takes."""
    if dtype in fmt.dtypes:
        return None
    others = [f.name for f in formats().values() if dtype in f.dtypes]
    what = f" ({DTYPE_WORDS[dtype]})" if dtype in DTYPE_WORDS else ""
    return f"--dtype {dtype} is for --format {' or '.join(others)}{what}; {fmt.takes}"


# -- reading the run (the only reads of the run folder: core/files.py's guarded helpers) ---------------------------
def read_student(run, checkpoint: str | None):
    """(the student's WanTransformer3DModel in fp32 on the CPU, the folder it came from). The final student unless
    `checkpoint` (best, latest, step_N, ema) names another; a run that never finished has no final student."""

    if checkpoint in (None, "ema"):
        source = final_student(run, checkpoint)
    else:
        source = student_source(run, checkpoint)
    return load_student(run, source, torch.device("cpu"), torch.float32), source


def final_student(run, checkpoint: str | None) -> Path:
    """The run's `student/` (`student_ema/` for --checkpoint ema), refused in one line where the run has none."""

    if checkpoint == "ema":
        source = in_run(run.path, "student_ema")
        if not source.is_dir():
            raise UserError(f"{run.path} has no student_ema/ (trainer.ema_decay was off); drop --checkpoint")
        return source
    source = in_run(run.path, "student")
    if not source.is_dir() and not list_checkpoints(run.path):  # stopped before its first checkpoint
        raise UserError(
            f"{run.path} has no student yet (no student/, checkpoints: none): it stopped before its first "
            "checkpoint; train it first (trainer.resume=auto)"
        )
    if not source.is_dir():
        # A LoRA student's files are written from its final student/ alone; the pipeline command takes a checkpoint's.
        other = (
            f"python -m wandistiller.pipeline {run.path} --out DIR writes its latest checkpoint's adapters"
            if is_lora_student(run)
            else "export a checkpoint's student with --checkpoint latest"
        )
        raise UserError(
            f"{run.path} has no final student (student/): the run did not finish; finish it (trainer.resume=auto), "
            f"or {other}"
        )
    return source


def run_card(run, phrases: Mapping[str, str]) -> str:
    """The run's model card (state/card.py), its metrics.json read only where it is the run's own file. `phrases`:
    what each method taught its student (`Request.phrases`: the methods sit above this layer)."""

    in_run(run.path, "metrics.json")  # a received run's link to a file elsewhere is refused, never read
    return model_card(run.path, run.spec.path, phrases=phrases)


def is_lora_student(run) -> bool:
    """Whether the run's student is low-rank adapters on the teacher (`student.builder: lora`), as saved (read raw:
    a received run's odd value is no LoRA, never an error here)."""

    return raw_value(run.cfg.student, "builder") == LORA_BUILDER


def saved_name(node, key: str) -> str:
    return saved_word(raw_value(node, key)) or "?"


# -- what the files say about sampling -----------------------------------------------------------------------------
def sampling_facts(run) -> dict:
    """The student's sampling as the file's metadata and README state it: K steps on its own Euler schedule for a
    few-step student (its timesteps and sigmas), else the run's evaluation steps on the teacher's scheduler; the
    flow shift; guidance 1."""

    k, spec = run.trained_steps, run.spec
    facts: dict = {"guidance_scale": 1.0, "shift": spec.flow_shift, "num_train_timesteps": spec.num_train_timesteps}
    if k is not None:
        schedule = run.trained_schedule
        timesteps, sigmas = student_schedule(spec, k, schedule)
        shift = schedule.shift if schedule.shift is not None else spec.flow_shift
        return facts | {
            "steps": k,
            "few_step": True,
            "scheduler": "FlowMatchEulerDiscreteScheduler",
            "schedule": schedule.record(),
            "shift": shift,
            "timesteps": [round(t, 4) for t in timesteps.tolist()],
            "sigmas": [round(s, 8) for s in sigmas.tolist()],
        }
    hooks = run.cfg.get("hooks")
    evaluate = hooks.get("evaluate") if hooks is not None and hasattr(hooks, "get") else None
    steps = saved_number(raw_value(evaluate, "steps")) if evaluate is not None else None
    return facts | {
        "steps": int(steps) if steps and steps >= 1 else 20,
        "few_step": False,
        "scheduler": "the teacher's",
    }


def exact_line(facts: dict) -> str:
    """The README's sentence on the sigmas the workflow samples at: the trained ones, and how it sets them."""
    sigmas = [round(v, 6) for v in facts["sigmas"]]
    if facts["schedule"] in ("simple", "beta"):
        how = (
            f"ComfyUI's own `{facts['schedule']}` scheduler at shift {facts['shift']:g} gives exactly these (the "
            "student was trained at them); another scheduler or shift samples it at sigmas it never saw."
        )
    else:
        how = (
            "The workflow sets exactly these with the core ManualSigmas node into SamplerCustomAdvanced (ComfyUI's "
            "KSampler schedulers give other sigmas: `simple` at this shift is close, not equal, and the student never "
            "saw them). ManualSigmas is a recent core node (checked against ComfyUI commit 065c1df); an older build "
            "lacks it."
        )
    return f"Its trained sigmas: {sigmas}. {how}"


def comfy_sampling(run, facts: dict, experts: int, wanted: str | None = None):
    """How the workflow samples: a few-step student at exactly its trained sigmas -- KSampler with ComfyUI's own
    scheduler of that name where it was trained at `simple` or `beta` (at the shift ModelSamplingSD3 is set to),
    else (diffusers' Euler, a list) the sigmas themselves (ManualSigmas); the teacher's steps with uni_pc else. An
    image-to-video student's (`wanted`: the workflow, default its teacher's own) samples its run's clip length
    through its teacher's first-frame node (state/comfy.py's IMAGE_NODES)."""
    scale, d = image_scale(run.spec.path), run.cfg.data
    boundary = run.spec.boundary_ratio if experts == 2 else None
    sampler, sigmas = ("uni_pc", "simple"), None
    if facts["few_step"]:
        named = facts["schedule"] in ("simple", "beta")
        sampler, sigmas = ("euler", facts["schedule"] if named else MANUAL), tuple(facts["sigmas"])
    layout = str(run.spec.layout)
    given: dict = {}
    if layout in IMAGE_NODES:  # its clip's length, and how its experts take the first frame
        given = {
            "frames": (int(d.latent_frames) - 1) * time_scale(run.spec.path) + 1,
            "image_node": IMAGE_NODES[layout],
            "first_frame": (wanted or default_workflow(layout)) == "image-to-video",
            "clip_vision": run.spec.image_encoder,
            "vae": VAE_22 if layout == "ti2v" else VAE,
        }
    return Sampling(
        facts["steps"],
        *sampler,
        facts["shift"],
        int(d.latent_width) * scale,
        int(d.latent_height) * scale,
        boundary,
        example_prompt(saved_prompts(run.cfg)),
        sigmas,
        **given,
    )


def check_name(fmt: ExportFormat, name: str | None) -> None:
    """`--name` for a format whose files take it: a diffusers folder ignored it without a word."""
    if name is not None and not fmt.named:
        takes = " or ".join(f.name for f in formats().values() if f.named)
        raise UserError(
            f"--name is for --format {takes} (a {fmt.name} export keeps diffusers' own file names); drop it"
        )


def check_workflow(run, fmt: ExportFormat, wanted: str | None) -> None:
    """`--workflow` one a format writes and the student's teacher takes, before any work: an image-to-video
    student's experts cannot run in a text-to-video workflow (no image to give them), nor the reverse."""
    if wanted is None:
        return
    if wanted not in WORKFLOWS:
        raise UserError(f"--workflow {wanted!r} is not one of {', '.join(WORKFLOWS)}")
    if not fmt.workflow:
        takes = " or ".join(f.name for f in formats().values() if f.workflow)
        raise UserError(f"--workflow is for --format {takes} (a {fmt.name} export has no workflow); drop it")
    layout = str(run.spec.layout)
    problem = workflow_problem(layout, wanted)
    if problem:
        teacher = saved_name(run.cfg.teacher, "name")
        raise UserError(
            f"--workflow {wanted}: the student of {run.path} was trained on teacher={teacher} ({layout}): {problem}; "
            f"drop --workflow (its teacher's own: {default_workflow(layout)})"
        )


def teacher_facts(run, source: Path) -> dict:

    name, hub_id = card_teacher(run.cfg)
    recorded = recorded_teacher(run, source) or {}
    digest = recorded.get("digest") if isinstance(recorded.get("digest"), str) else None
    return {
        "name": name,
        "hub_id": hub_id,
        "digest": digest,
        "boundary_ratio": run.spec.boundary_ratio,
        "pipeline": pipeline_name(run.spec.path),  # the diffusers class that samples it: I2V's takes the image
    }
