"""A run folder's `pipeline/`: the student transformer beside the teacher's tokenizer, text encoder, VAE and
scheduler, with a model card, which `WanPipeline.from_pretrained` loads in one call. Written at the end of
every run (recipe/outputs.py) and by `python -m wandistiller.pipeline` (its export to a folder of real files).
Files are hard links where the filesystem allows (no extra disk, even for a 14B teacher's 11 GB text encoder);
on another filesystem small files are copied and large ones symlinked (a documented reference).

A few-step student (`method.steps` = K in the run's saved config) carries its step count: the pipeline's
`scheduler/` is its few-step scheduler (teacher/fewstep.py) rather than the teacher's, so
`WanPipeline.from_pretrained(...)(prompt, num_inference_steps=K, guidance_scale=1.0)` samples on its own
timesteps; `student/sampling.json` (and the pipeline's `transformer/sampling.json`) state K, its timesteps and
sigmas, and the model card says them. That scheduler is K's: at another count diffusers stretches its schedule
to end at K's last point (at 1 step, 0 / 0: NaN), so the card shows how to rebuild the n-step one with diffusers
alone (`other_steps`), as `eval`/`generate --student-steps n` do. A KD student's export is as before.

An image-to-video teacher's student is that teacher's own pipeline: its model_index.json (WanImageToVideoPipeline, or
TI2V 5B's WanPipeline with expand_timesteps) and, for Wan 2.1 I2V, its image encoder and processor; the card's snippet
loads it with WanImageToVideoPipeline and passes the clip's first frame (`PIPELINES`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from omegaconf import DictConfig

from wandistiller.core.errors import UserError
from wandistiller.core.files import check_tree, in_run, open_in, replace_folder, write_in_run
from wandistiller.state.card import model_card
from wandistiller.state.received import load_yaml_config
from wandistiller.state.runs import student_schedule_of, student_steps
from wandistiller.state.saved import run_loras, saved_word
from wandistiller.student.lora import ADAPTERS_JSON, WEIGHTS, is_lora_folder
from wandistiller.teacher.fewstep import Schedule, few_step_scheduler, student_schedule
from wandistiller.teacher.model import save_finetuned_expert
from wandistiller.teacher.spec import PIPELINES, TeacherSpec, inspect_teacher, teacher_layout

log = logging.getLogger("wandistiller.pipeline")

PIPELINE = "pipeline"
TEACHER_PARTS = ("tokenizer", "text_encoder", "vae", "scheduler")
# Wan 2.1 I2V's CLIP vision tower and its processor: the image-to-video pipeline encodes the given image with them, so
# a student of that teacher needs them beside it (teachers without them name them [null, null] or not at all).
IMAGE_PARTS = ("image_encoder", "image_processor")
SAMPLING = "sampling.json"  # a few-step student's K, timesteps and sigmas, in its folder


COPY_LIMIT = 2**30  # larger files that cannot be hard-linked are referenced (symlinked), not copied


def place(src: Path, dst: Path, root: Path | None = None) -> str:
    """`dst` as a hard link to `src` (a Hub cache's symlink followed to its blob); on another filesystem a
    copy, or for a file over COPY_LIMIT (a 14B teacher's text encoder) a symlink: every run would otherwise
    hold its own 11+ GB. The export (`--out`) always writes real files.

    `root`: the folder `src` was received in (a run's student/): `src` is opened through the guard (core.files), a
    link out of it refused, and `dst` is a hard link to (or a copy of) the file the guard opened -- never a link to
    whatever the name points at by then; never a symbolic link. None: the user's own teacher's file."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.unlink(missing_ok=True)
    if root is not None:
        return _place_guarded(root, src, dst)
    real = src.resolve()
    try:
        os.link(real, dst)
        return "linked"
    except OSError:  # another filesystem, or one without hard links
        if real.stat().st_size > COPY_LIMIT:
            os.symlink(real, dst)
            return "referenced"
        shutil.copy2(real, dst)
        return "copied"


def _place_guarded(root: Path, src: Path, dst: Path) -> str:
    """`dst` as a hard link to the file the guard opened at `src` (its device and inode compared after linking: a
    name swapped meanwhile is undone), else a copy of what the guard opened."""

    with open_in(root, src) as f:
        opened = os.fstat(f.fileno())
        try:  # the resolved name (no link followed), then checked: the new name must be the opened file's
            os.link(os.path.realpath(src), dst, follow_symlinks=False)
            made = os.stat(dst, follow_symlinks=False)
            if (made.st_dev, made.st_ino) == (opened.st_dev, opened.st_ino):
                return "linked"
            dst.unlink()
        except OSError:  # another filesystem, or one without hard links
            pass
        write_in_run(dst.parent, dst.name, write=lambda out: shutil.copyfileobj(f, out, 2**24))
    return "copied"


def run_pipeline(
    run_dir: Path, teacher_path: Path, phrases: Mapping[str, str] | None = None, spec: TeacherSpec | None = None
) -> Path:
    """`<run>/pipeline/`: the run's final student in the teacher's WanPipeline, with its model card; a few-step
    student's `student/sampling.json` first (its K read from the run's saved config). `spec`: the run's teacher, its
    LoRAs (teacher.lora) with it: a LoRA student's pipeline holds that fine-tuned teacher."""

    # The run's own teacher read once (preflight's spec), not again for the card and the log line.
    layout = spec.layout if spec is not None else teacher_layout(teacher_path)
    student, card = in_run(run_dir, "student"), model_card(run_dir, teacher_path, phrases=phrases, layout=layout)
    steps, schedule, loras = saved_steps(run_dir), saved_schedule(run_dir), run_loras(run_dir)
    if steps is not None:  # written whole, never through a link in its place
        write_in_run(student, SAMPLING, json.dumps(sampling(teacher_path, steps, schedule, loras), indent=2))
    # Written whole into a new folder that takes the old one's place: a received run's `pipeline/` that is a link
    # (or holds links) is replaced, never written through.
    if is_lora_folder(student):  # a LoRA student: the teacher's own pipeline (fine-tuned: with its LoRAs merged)
        finetuned = spec if spec is not None and spec.loras else None
        write: Callable[..., Path] = functools.partial(write_lora_pipeline, finetuned=finetuned)
    else:
        write = write_pipeline
    out = replace_folder(
        run_dir, PIPELINE, lambda tmp: write(tmp, teacher_path, student, card, steps, schedule=schedule, loras=loras)
    )
    log.info("student pipeline: %s (%s.from_pretrained loads it in one call)", out, PIPELINES[layout])
    return out


def write_pipeline(
    out: Path,
    teacher_path: Path,
    student_dir: Path,
    card: str,
    steps: int | None = None,
    student_root: Path | None = None,
    schedule: Schedule | None = None,
    loras: Sequence[dict] = (),
) -> Path:
    """A WanPipeline folder: `student_dir` as its transformer, the teacher's other parts, `card` as README.md. A
    few-step student (`steps` = K) has its few-step scheduler in place of the teacher's, and its sampling.json.
    `student_root`: the run folder `student_dir` lies in (default the folder itself): its files are placed through
    the guard (`place`), a link out of it refused."""

    how = set()
    check_tree(student_root or student_dir, student_dir)  # before anything is placed: a link out is one line
    for part, src in [("transformer", student_dir)] + [(p, teacher_path / p) for p in teacher_parts(teacher_path)]:
        if not src.is_dir():
            raise UserError(
                f"{src} is missing: the teacher folder has no {part}/; a {folder_class(teacher_path)} needs one"
            )
        if steps is not None and part == "scheduler":
            continue
        for file in sorted(f for f in src.rglob("*") if f.is_file()):
            if steps is not None and part == "transformer" and file == src / SAMPLING:
                continue  # written below, its own file (never a link to the student's)
            root = (student_root or student_dir) if part == "transformer" else None  # the teacher's: the user's own
            how.add(place(file, out / part / file.relative_to(src), root))
    if steps is not None:
        few_step_scheduler(inspect_teacher(teacher_path), steps).save_pretrained(out / "scheduler")
        facts = sampling(teacher_path, steps, schedule, loras)
        write_in_run(out, f"transformer/{SAMPLING}", json.dumps(facts, indent=2))
    write_in_run(out, "model_index.json", json.dumps(model_index(teacher_path, steps), indent=2))
    write_in_run(out, "README.md", card)
    if "referenced" in how:  # the folder then depends on the teacher's files staying where they are
        log.info(
            "pipeline %s: the teacher's large files are symlinks to %s (another filesystem); "
            "python -m wandistiller.pipeline RUN --out DIR writes a self-contained copy",
            out,
            teacher_path,
        )
    return out


def write_lora_pipeline(
    out: Path,
    teacher_path: Path,
    student_dir: Path,
    card: str,
    steps: int | None = None,
    schedule: Schedule | None = None,
    loras: Sequence[dict] = (),
    finetuned: TeacherSpec | None = None,
    root: Path | None = None,
) -> Path:
    """A LoRA student's WanPipeline folder (student=lora): the teacher's own pipeline (its transformer, and
    transformer_2 of a pair, as they are), the adapters beside it as diffusers writes them (`pytorch_lora_weights
    .safetensors`, `..._transformer_2.safetensors`: `pipe.load_lora_weights(folder)` loads them), its adapters.json,
    a few-step student's scheduler and sampling.json, and `card` as README.md. `finetuned`: the teacher with the
    LoRAs it was fine-tuned with (teacher.lora), whose experts are written merged (the adapters' own base). `root`:
    the folder the student's files may not lead out of (its run's); None: `student_dir`."""

    index = teacher_index(teacher_path)
    parts = [
        p
        for p in ("transformer", "transformer_2", *TEACHER_PARTS, *IMAGE_PARTS)
        if isinstance(index.get(p), list) and index[p][0] is not None
    ]
    for part in parts:
        if steps is not None and part == "scheduler":
            continue
        src = teacher_path / part
        if not src.is_dir():
            raise UserError(
                f"{src} is missing: the teacher folder has no {part}/; a {folder_class(teacher_path)} needs one"
            )
        if finetuned is not None and any(part in lora.experts for lora in finetuned.loras):
            save_finetuned_expert(finetuned, part, out / part)  # the fine-tuned teacher the adapters were trained on
            continue
        for file in sorted(f for f in src.rglob("*") if f.is_file()):
            place(file, out / part / file.relative_to(src))
    for name in (*WEIGHTS, ADAPTERS_JSON):
        if (student_dir / name).is_file():  # through the guard: a received student's link out of it is refused
            place(student_dir / name, out / name, root or student_dir)
    if steps is not None:
        few_step_scheduler(inspect_teacher(teacher_path), steps).save_pretrained(out / "scheduler")
        facts = sampling(teacher_path, steps, schedule, loras)
        write_in_run(out, f"transformer/{SAMPLING}", json.dumps(facts, indent=2))
        index |= {"scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    write_in_run(out, "model_index.json", json.dumps(index, indent=2))
    write_in_run(out, "README.md", card)
    return out


def teacher_index(teacher_path: Path) -> dict:
    """The teacher's own model_index.json (the user's teacher, not a received folder's file)."""
    return json.loads((teacher_path / "model_index.json").read_text())


def teacher_parts(teacher_path: Path) -> tuple[str, ...]:
    """The teacher's parts a student's pipeline holds beside it: the text and VAE parts, and the image encoder and
    its processor where the teacher's model_index.json names them (Wan 2.1 I2V)."""
    index = teacher_index(teacher_path) if (teacher_path / "model_index.json").is_file() else {}
    named = tuple(p for p in IMAGE_PARTS if isinstance(index.get(p), list) and index[p][0] is not None)
    return TEACHER_PARTS + named


def folder_class(teacher_path: Path) -> str:
    """The pipeline class the teacher's model_index.json names (a missing part's line says it); WanPipeline if none."""
    index = teacher_index(teacher_path) if (teacher_path / "model_index.json").is_file() else {}
    return saved_word(index.get("_class_name")) or "WanPipeline"


def model_index(teacher_path: Path, steps: int | None = None) -> dict:
    """The teacher's model_index.json, one expert and no boundary: the student is a single transformer; a few-step
    student's (`steps`) scheduler is its few-step FlowMatchEulerDiscreteScheduler."""
    index = teacher_index(teacher_path)  # an image-to-video teacher's class and image parts kept: the student's too
    few_step = {"scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]} if steps is not None else {}
    return (
        index
        | {"transformer": ["diffusers", "WanTransformer3DModel"], "transformer_2": [None, None], "boundary_ratio": None}
        | few_step
    )


def saved_steps(run_dir: Path) -> int | None:
    """The run's student's step count K from its saved config (`method.steps`); None for a KD student."""

    cfg = load_yaml_config(run_dir / ".hydra" / "config.yaml", root=run_dir)  # through the guard, its size bounded
    return student_steps(cfg) if isinstance(cfg, DictConfig) else None


def saved_schedule(run_dir: Path) -> Schedule:
    """The run's few-step student's schedule from its saved config (`method.schedule`, `method.shift`)."""

    cfg = load_yaml_config(run_dir / ".hydra" / "config.yaml", root=run_dir)  # through the guard, its size bounded
    return student_schedule_of(cfg) if isinstance(cfg, DictConfig) else Schedule()


def sampling(teacher_path: Path, steps: int, schedule: Schedule | None = None, loras: Sequence[dict] = ()) -> dict:
    """What `sampling.json` states of a K-step student: its steps, the schedule it was trained at (`schedule`),
    its timesteps and sigmas, and no CFG. Where that schedule is not diffusers' Euler, the saved scheduler (which
    only that one can be set to) samples other sigmas at num_inference_steps=K: `scheduler_sigmas` says which.
    `loras`: the LoRAs its teacher was fine-tuned with (`run_loras`), named as `teacher_loras`."""
    spec = inspect_teacher(teacher_path)
    schedule = schedule or Schedule()
    timesteps, sigmas = student_schedule(spec, steps, schedule)
    facts = {
        "steps": steps,
        "schedule": schedule.record(),
        "shift": schedule.shift if schedule.shift is not None else spec.flow_shift,
        "timesteps": [round(t, 4) for t in timesteps.tolist()],
        "sigmas": [round(s, 6) for s in sigmas.tolist()],
        "guidance_scale": 1.0,
        "scheduler": "FlowMatchEulerDiscreteScheduler",
    }
    if schedule.name != "euler":
        facts["scheduler_sigmas"] = [round(s, 6) for s in student_schedule(spec, steps)[1].tolist()]
    if loras:
        facts["teacher_loras"] = list(loras)
    return facts
