"""The student as a whole diffusers pipeline: `<run>/pipeline/`, which `WanPipeline.from_pretrained` (an
image-to-video teacher's student: `WanImageToVideoPipeline.from_pretrained`) loads in one call, and
`python -m wandistiller.pipeline RUN --out DIR`, which writes what `push_to_hub` would send.

`<run>/pipeline/` is the student transformer beside the teacher's tokenizer, text encoder, VAE and
scheduler, with a model card (README.md). Its files are hard links to the run's `student/` and to the
teacher's files where the filesystem allows (no extra disk, even for a 14B teacher's 11 GB text encoder);
on another filesystem small files are copied and large ones symlinked (a documented reference). The
student was trained on guided targets, so it samples with `guidance_scale=1`; a few-step student's scheduler is
its own (state/export.py), so `num_inference_steps=K` samples on its timesteps.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError

from wandistiller.compose import register_configs
from wandistiller.core.errors import OneLineParser, UserError, description, exit_on_user_error, internal_errors_reported
from wandistiller.core.files import folder_problem, in_run, output_problem, read_json_in, write_in_run
from wandistiller.recipe.methods import card_phrases
from wandistiller.state.card import model_card
from wandistiller.state.checkpoint import load_checkpoint
from wandistiller.state.export import (  # the folder is made there (every run's end writes it)
    COPY_LIMIT,
    PIPELINE,
    SAMPLING,
    TEACHER_PARTS,
    model_index,
    place,
    run_pipeline,
    write_lora_pipeline,
    write_pipeline,
)
from wandistiller.state.runs import load_student, open_run, student_source
from wandistiller.student.lora import ADAPTERS_JSON, WEIGHTS, adapters_from, is_lora, is_lora_folder, save_adapters
from wandistiller.teacher.model import load_expert

log = logging.getLogger(__name__)

__all__ = [
    "COPY_LIMIT",
    "PIPELINE",
    "TEACHER_PARTS",
    "export",
    "model_card",
    "model_index",
    "place",
    "run_pipeline",
    "write_pipeline",
]


def export(run_dir: Path, out: Path, checkpoint: str | None = None, merge_lora: bool = False) -> Path:
    """What `WanPipeline.push_to_hub` would upload, written to `out`: the pipeline's `save_pretrained`
    (every file a real copy, safetensors) and its model card. `checkpoint` (best, latest, step_N, ema) picks
    another student than the final one. Built in a temporary folder beside `out` (never inside the run, which
    may be read-only) and renamed into place whole: a full disk, an error or a kill leaves no partial export."""

    register_configs()  # the registries' options, which the run's config may name
    run = open_run(run_dir)
    if merge_lora and not is_lora(run.cfg.student):
        raise UserError(
            f"--merge-lora: {run_dir} trained student={run.cfg.student.get('builder') or 'from_json'}, "
            "a transformer of its own with no adapters to merge; drop --merge-lora"
        )
    _check_out(out)
    lora = is_lora(run.cfg.student)
    student = _student(run, checkpoint) if not lora else _lora_source(run, checkpoint)  # read before any write
    try:
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
            built = _build_lora(run, Path(tmp), student, merge_lora) if lora else _build(run, Path(tmp), student)
            if out.is_dir():  # an empty folder the user made: replaced by the whole export
                out.rmdir()
            built.rename(out)
    except (OSError, SafetensorError) as e:  # a full disk, a quota: safetensors words it "I/O error: …"
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).rsplit(": ", 1)[-1]
        raise UserError(
            f"--out {out}: the export could not be written ({why}); free some space or choose "
            "another folder (nothing was left there)"
        ) from None
    return out


def _check_out(out: Path) -> None:
    """`out` new or an empty folder, in a folder that can be written: before any work."""

    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; choose a new folder (an export never overwrites)")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"--out {out} is not empty; choose a new folder (an export never overwrites)")
    problem = folder_problem(out) or output_problem(out.parent)  # tried: a file is made there and removed
    if problem:
        raise UserError(f"--out {out}: {problem}; choose another folder")
    out.parent.mkdir(parents=True, exist_ok=True)


def _student(run, checkpoint: str | None):
    """The student to export: `student_ema/`'s folder, or the final or a checkpoint's WanTransformer3DModel."""

    if checkpoint != "ema":
        return load_student(run, student_source(run, checkpoint), torch.device("cpu"))
    student = in_run(run.path, "student_ema")  # never a received folder's link to a student elsewhere
    if not student.is_dir():
        raise UserError(f"{run.path} has no student_ema/ (trainer.ema_decay was off); drop --checkpoint")
    return student


def _lora_source(run, checkpoint: str | None) -> Path:
    """A LoRA student's adapters to export: the final `student/`, `student_ema/`, or a checkpoint's."""

    if checkpoint != "ema":
        return student_source(run, checkpoint)
    student = in_run(run.path, "student_ema")
    if not student.is_dir():
        raise UserError(f"{run.path} has no student_ema/ (trainer.ema_decay was off); drop --checkpoint")
    return student


def _build_lora(run, tmp: Path, source: Path, merge: bool) -> Path:
    """A LoRA student's export: the teacher's pipeline (`save_pretrained`, real copies) with the adapters beside it
    as diffusers writes them, or (`merge`) with them merged into its transformers (W + alpha/rank B A)."""
    from diffusers import DiffusionPipeline

    if not is_lora_folder(source):  # a checkpoint: its adapters written as a student/ folder first
        experts = [load_expert(run.spec, name, torch.float32) for name in run.spec.experts]
        state = load_checkpoint(source)["student"]
        save_adapters(tmp / "student", adapters_from(source, run.cfg.student, experts, state))
        source = tmp / "student"
    card = model_card(run.path, run.spec.path, merged=merge, phrases=card_phrases())
    folder = write_lora_pipeline(
        tmp / PIPELINE,
        run.spec.path,
        source,
        card,
        run.trained_steps,
        schedule=run.trained_schedule,
        loras=[lora.public() for lora in run.spec.loras],
        finetuned=run.spec if run.spec.loras else None,  # the fine-tuned teacher the adapters were trained on
    )
    # The class the folder's model_index.json names: an image-to-video teacher's pipeline keeps its image parts
    pipe = DiffusionPipeline.from_pretrained(folder)
    experts = [pipe.transformer] + ([pipe.transformer_2] if getattr(pipe, "transformer_2", None) is not None else [])
    if merge:
        for expert, adapters in zip(experts, adapters_from(source, run.cfg.student, experts)):
            adapters.merge_into(expert)
    built = tmp / "export"
    pipe.save_pretrained(built, safe_serialization=True)
    shutil.copy2(folder / "README.md", built / "README.md")
    for name in () if merge else (*WEIGHTS, ADAPTERS_JSON):
        if (folder / name).is_file():
            shutil.copy2(folder / name, built / name)
    if (folder / "transformer" / SAMPLING).is_file():
        shutil.copy2(folder / "transformer" / SAMPLING, built / "transformer" / SAMPLING)
    _drop_local_paths(built)
    return built


def _drop_local_paths(built: Path) -> None:
    """diffusers records where it loaded from: this machine's temporary path, dropped from every config."""
    for config in built.rglob("*.json"):
        name = config.relative_to(built)
        body = read_json_in(built, name)
        if isinstance(body, dict) and body.pop("_name_or_path", None) is not None:
            write_in_run(built, name, json.dumps(body, indent=2, sort_keys=True) + "\n")


def _build(run, tmp: Path, student) -> Path:
    """The export in `tmp`/export, from the pipeline folder assembled in `tmp`/pipeline."""
    from diffusers import DiffusionPipeline

    if not isinstance(student, Path):
        student.save_pretrained(tmp / "student")
        student = tmp / "student"
    root = run.path if student.is_relative_to(run.path) else student  # the received run's, or the one saved here
    folder = write_pipeline(
        tmp / PIPELINE,
        run.spec.path,
        student,
        model_card(run.path, run.spec.path, phrases=card_phrases()),
        run.trained_steps,
        root,
        schedule=run.trained_schedule,
        loras=[lora.public() for lora in run.spec.loras],
    )
    built = tmp / "export"
    # The class the folder's model_index.json names (an image-to-video teacher's, with its image parts)
    DiffusionPipeline.from_pretrained(folder).save_pretrained(built, safe_serialization=True)
    shutil.copy2(folder / "README.md", built / "README.md")
    if (folder / "transformer" / SAMPLING).is_file():  # a few-step student's K and timesteps, which diffusers drops
        shutil.copy2(folder / "transformer" / SAMPLING, built / "transformer" / SAMPLING)
    for config in built.rglob("*.json"):  # diffusers records where it loaded from: this machine's temporary path
        body = read_json_in(built, config)
        if isinstance(body, dict) and body.pop("_name_or_path", None) is not None:
            write_in_run(built, config, json.dumps(body, indent=2, sort_keys=True) + "\n")
    return built


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m wandistiller.pipeline", description=description(__doc__))
    parser.add_argument("run_dir", help="a run folder (outputs/<date>/<time>)")
    parser.add_argument("--out", required=True, help="a new folder: what push_to_hub would upload")
    parser.add_argument(
        "--checkpoint",
        help="best, latest, step_N or ema (default: the final student; of a run that did not finish, its latest "
        "checkpoint, said)",
    )
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA student (student=lora): its adapters "
        "merged into full teacher-sized transformers, one self-contained pipeline",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # unwinds: the temporary folder goes
    with internal_errors_reported(), exit_on_user_error():
        out = export(Path(args.run_dir), Path(args.out), args.checkpoint, args.merge_lora)
        print(f"wrote {out}; upload it with: hf upload <user>/<repo> {out}")


if __name__ == "__main__":
    main()
