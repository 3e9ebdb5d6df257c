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
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

from safetensors import SafetensorError

from wandistiller.compose import register_configs
from wandistiller.core.errors import OneLineParser, UserError, description
from wandistiller.core.files import folder_problem, out_folder_problem, output_problem
from wandistiller.core.stopping import tool_session
from wandistiller.recipe.methods import card_phrases
from wandistiller.state.card import model_card
from wandistiller.state.export import (  # the folder is made there (every run's end writes it)
    COPY_LIMIT,
    PIPELINE,
    TEACHER_PARTS,
    model_index,
    place,
    run_pipeline,
    write_pipeline,
)
from wandistiller.state.formats.diffusers import pipeline_folder, pipeline_student
from wandistiller.state.runs import check_out_of_inputs, open_relocated, run_folder_arg
from wandistiller.state.trust import add_teacher_args
from wandistiller.student.lora import is_lora

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


def export(
    run_dir: Path,
    out: Path,
    checkpoint: str | None = None,
    merge_lora: bool = False,
    teacher_path: str | None = None,
    teacher_loras: Sequence[str] | None = None,
) -> Path:
    """What `WanPipeline.push_to_hub` would upload, written to `out`: the pipeline's `save_pretrained`
    (every file a real copy, safetensors) and its model card. `checkpoint` (best, latest, step_N, ema) picks
    another student than the final one. Built in a temporary folder beside `out` (never inside the run, which
    may be read-only) and renamed into place whole: a full disk, an error or a kill leaves no partial export.
    `teacher_path`, `teacher_loras`: where the run's teacher and its LoRAs lie now, held to what the run recorded."""

    register_configs()  # the registries' options, which the run's config may name
    run = open_relocated(run_dir, teacher_path, teacher_loras, checkpoint)
    if merge_lora and not is_lora(run.cfg.student):
        raise UserError(
            f"--merge-lora: {run_dir} trained student={run.cfg.student.get('builder') or 'from_json'}, "
            "a transformer of its own with no adapters to merge; drop --merge-lora"
        )
    check_out_of_inputs(out, run)
    _check_out(out)
    student = pipeline_student(run, checkpoint)  # read before any write
    try:
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
            built = pipeline_folder(run, Path(tmp), student, merge_lora, card_phrases())
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
    problem = out_folder_problem(out, "the whole pipeline's folders go in it")
    if problem:
        raise UserError(problem)
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"--out {out} is not empty; choose a new folder (an export never overwrites)")
    problem = folder_problem(out) or output_problem(out.parent)  # tried: a file is made there and removed
    if problem:
        raise UserError(f"--out {out}: {problem}; choose another folder")
    out.parent.mkdir(parents=True, exist_ok=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m wandistiller.pipeline", description=description(__doc__))
    parser.add_argument("run_dir", type=run_folder_arg, help="a run folder (outputs/<date>/<time>)")
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
    add_teacher_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tool_session(unwind_on_term=True):  # a SIGTERM unwinds: the temporary folder goes
        out = export(
            Path(args.run_dir), Path(args.out), args.checkpoint, args.merge_lora, args.teacher_path, args.teacher_lora
        )
        print(f"wrote {out}; upload it with: hf upload <user>/<repo> {out}")


if __name__ == "__main__":
    main()
