"""The student as a whole diffusers pipeline: `<run>/pipeline/`, which `WanPipeline.from_pretrained` loads
in one call, and `python -m wandistiller.pipeline RUN --out DIR`, which writes what `push_to_hub` would send.

`<run>/pipeline/` is the student transformer beside the teacher's tokenizer, text encoder, VAE and
scheduler, with a model card (README.md). Its files are hard links to the run's `student/` and to the
teacher's files where the filesystem allows (no extra disk, even for a 14B teacher's 11 GB text encoder);
on another filesystem small files are copied and large ones symlinked (a documented reference). The
student was trained on guided targets, so it samples with `guidance_scale=1`.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

from wandistiller.core.errors import UserError, exit_on_user_error, internal_errors_reported
from wandistiller.core.files import in_run
from wandistiller.state.export import (  # the folder is made there (every run's end writes it)
    COPY_LIMIT,
    PIPELINE,
    TEACHER_PARTS,
    model_card,
    model_index,
    place,
    run_pipeline,
    write_pipeline,
)

log = logging.getLogger(__name__)

__all__ = ["COPY_LIMIT", "PIPELINE", "TEACHER_PARTS", "export", "model_card", "model_index", "place", "run_pipeline",
           "write_pipeline"]  # fmt: skip


def export(run_dir: Path, out: Path, checkpoint: str | None = None) -> Path:
    """What `WanPipeline.push_to_hub` would upload, written to `out`: the pipeline's `save_pretrained`
    (every file a real copy, safetensors) and its model card. `checkpoint` (best, latest, step_N, ema) picks
    another student than the final one."""
    import tempfile

    import torch
    from diffusers import WanPipeline

    from wandistiller.state.runs import load_student, open_run, student_source

    run = open_run(run_dir)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} is not empty; choose a new folder (an export never overwrites)")
    with tempfile.TemporaryDirectory(dir=run.path) as tmp:
        if checkpoint == "ema":
            student = in_run(run.path, "student_ema")  # never a received folder's link to a student elsewhere
            if not student.is_dir():
                raise UserError(f"{run.path} has no student_ema/ (trainer.ema_decay was off); drop --checkpoint")
        else:
            student = Path(tmp) / "student"
            load_student(run, student_source(run, checkpoint), torch.device("cpu")).save_pretrained(student)
        folder = write_pipeline(Path(tmp) / PIPELINE, run.spec.path, student, model_card(run.path))
        WanPipeline.from_pretrained(folder).save_pretrained(out, safe_serialization=True)
        shutil.copy2(folder / "README.md", out / "README.md")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m wandistiller.pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run folder (outputs/<date>/<time>)")
    parser.add_argument("--out", required=True, help="a new folder: what push_to_hub would upload")
    parser.add_argument("--checkpoint", help="best, latest, step_N or ema (default: the final student)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with internal_errors_reported(), exit_on_user_error():
        out = export(Path(args.run_dir), Path(args.out), args.checkpoint)
        print(f"wrote {out}; upload it with: hf upload <user>/<repo> {out}")


if __name__ == "__main__":
    sys.exit(main())
