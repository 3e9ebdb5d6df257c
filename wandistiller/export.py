"""Export a run's student where Wan users run models: a diffusers pipeline folder, or single `.safetensors` files in
the Wan reference layout (bf16, fp16, fp32 or fp8 in ComfyUI's per-layer `.comfy_quant` layout) with a ComfyUI
workflow, README and model card.

`python -m wandistiller.export RUN --format diffusers|single-file|lora [--dtype bf16|fp16|fp32|fp8] --out DIR`

- `diffusers`: what `python -m wandistiller.pipeline RUN --out DIR` writes (WanPipeline.from_pretrained loads it),
  its transformer in `--dtype` (default: as saved, fp32).
- `single-file`: `<name>.safetensors` (an A14B pair: `<name>_high_noise` / `<name>_low_noise`) in the Wan reference
  layout (state/singlefile.py), its metadata the student's config, sampling and teacher; `config.json` beside it
  (diffusers' `from_single_file(config=DIR)`), `<name>.workflow.json` for ComfyUI (state/comfy.py) and README.md:
  the model card, every file and the lines that load it. `--dtype` default bf16. A LoRA student's single file is
  its teacher with the adapters merged (what `pipeline --merge-lora` writes), one per expert of a pair.
- `lora`: a LoRA student's adapters (student=lora; refused for any other student): `<name>.safetensors` (an A14B
  pair: `<name>_high_noise` / `<name>_low_noise`) in the Lightning layout ComfyUI's LoraLoader and diffusers'
  `load_lora_weights` read (state/loralayout.py), `diffusers/` with the files diffusers' `save_lora_weights` wrote
  (the student's own, copied or cast), a few-step student's `scheduler/`, `<name>.workflow.json` (the teacher's
  diffusion model, LoraLoaderModelOnly, the few-step sampler) and README.md. `--dtype` bf16 (default), fp16 or fp32.

An image-to-video student's workflow gives its clip's first frame through its teacher's own ComfyUI node (LoadImage
into WanImageToVideoPipeline's counterpart WanImageToVideo, with CLIPVisionEncode for Wan 2.1 I2V; TI2V 5B's
Wan22ImageToVideoLatent), and its lines load WanImageToVideoPipeline. `--workflow text-to-video|image-to-video` picks
the workflow (default the teacher's own); one the student's experts cannot run in is refused before any work.

Each format is a record of `wandistiller/state/formats/` (its module: dtypes, default dtype, which runs it takes,
its writer); this CLI checks what is asked, then runs the record's writer. Everything is written into a temporary
folder beside `--out` and renamed into place at the end: an error, a full disk or a kill leaves nothing partly written
there. The run folder is only read (through core/files.py's guarded
helpers: a received run's link that leads out of it is refused), and `--out` may not lie inside it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from safetensors import SafetensorError

from wandistiller.compose import register_configs
from wandistiller.core.atomic import flocked, umask
from wandistiller.core.errors import OneLineParser, UserError, description
from wandistiller.core.files import folder_problem, held_run, out_folder_problem, read_text_in
from wandistiller.core.stopping import tool_session
from wandistiller.recipe.methods import card_phrases
from wandistiller.state.comfy import WORKFLOWS
from wandistiller.state.formats.base import (
    DTYPES,
    Request,
    check_name,
    check_workflow,
    dtype_refusal,
    final_student,
    formats,
    is_lora_student,
)
from wandistiller.state.runs import RunFolder, check_out_of_inputs, open_relocated, run_folder_arg
from wandistiller.state.singlefile import FP8_LAYOUTS
from wandistiller.state.trust import add_teacher_args

log = logging.getLogger("wandistiller.export")

FORMATS = formats()  # by name: each a record of wandistiller/state/formats/


# -- checks before anything is read or written ---------------------------------------------------------------------
def check_out(out: Path, run: RunFolder, force: bool) -> None:
    """`--out` new, or empty, or (with --force) an existing folder to replace; never inside the run folder, nor
    the teacher's."""

    check_out_of_inputs(out, run)  # --force would remove a run, or its teacher, with the folder it replaces
    problem = out_folder_problem(out, "the export's files, its card and workflow, go in it: --name names the files")
    if problem:  # `--out student.safetensors` made a folder of that name
        raise UserError(problem)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(f"--out {out} is a file or a link; choose a new folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--out {out} is not empty; choose a new folder, or add --force to replace it")
    run_inside = held_run(out) if force and out.is_dir() else None
    if run_inside is not None:  # --force replaces the folder whole, never a training run's outputs
        raise UserError(
            f"--out {out} holds the run folder {run_inside}; --force replaces the folder --out names (its files "
            "gone), never one holding a run: choose another folder"
        )
    if force and out.is_dir() and any(out.iterdir()) and not an_export(out):
        # `--out ~ --force` (or a data folder's name) would have moved it whole into the temporary folder, and gone
        held = ", ".join(sorted(p.name for p in out.iterdir())[:3])
        raise UserError(
            f"--out {out} holds files no export wrote ({held}, …: no WanDistiller model card README.md); --force "
            "replaces only an earlier export: choose a new folder"
        )
    problem = folder_problem(out)
    if problem:
        raise UserError(f"--out {out}: {problem}; choose another folder")


def an_export(folder: Path) -> bool:
    """Whether `folder` is an earlier export, which --force may replace: its own model card at the top, which every
    format writes (state/card.py)."""
    try:
        card = read_text_in(folder, "README.md", limit=2**20, what="model card")
    except UserError:  # none, a link, too large, not text: not a card an export wrote
        return False
    return "Distilled with WanDistiller" in card


def export(
    run_dir: Path,
    out: Path,
    fmt: str = "single-file",
    dtype: str | None = None,
    checkpoint: str | None = None,
    force: bool = False,
    name: str | None = None,
    fp8_layout: str | None = None,
    workflow: str | None = None,
    teacher_path: str | None = None,
    teacher_loras: Sequence[str] | None = None,
) -> Path:
    """Write the run's student to `out` in `fmt`, whole or not at all. `fp8_layout`: --dtype fp8's layout
    (comfy_quant, the default, or scaled_fp8). `workflow`: the ComfyUI workflow's kind (state/comfy.py's WORKFLOWS;
    default the teacher's own). `teacher_path`, `teacher_loras`: where the run's teacher and its LoRAs lie now."""

    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if name is not None and (not re.fullmatch(r"[\w+-][\w.+-]{0,99}", name)):  # never a path out of --out
        raise UserError(f"--name {name!r} is not a plain file name; use letters, digits and ._+- (e.g. my_student)")
    if fp8_layout is not None and fp8_layout not in FP8_LAYOUTS:
        raise UserError(f"--fp8-layout {fp8_layout!r} is not one of {', '.join(FP8_LAYOUTS)}")
    if fp8_layout is not None and dtype != "fp8":
        raise UserError(f"--fp8-layout {fp8_layout} is for --dtype fp8 (single-file); drop it, or add --dtype fp8")
    register_configs()  # the registries' options, which the run's config may name
    run = open_relocated(run_dir, teacher_path, teacher_loras, checkpoint)
    check_out(out, run, force)
    record = FORMATS[fmt]
    problem = record.refusal(run) or (dtype_refusal(record, dtype) if dtype is not None else None)
    if problem:
        raise UserError(problem)
    check_workflow(run, record, workflow)
    check_name(record, name)
    if is_lora_student(run) and checkpoint is not None:
        raise UserError(
            f"--checkpoint {checkpoint} with a LoRA student: its files are written from the run's final student/; "
            + ("drop --checkpoint" if (run.path / "student").is_dir() else "finish the run (trainer.resume=auto)")
            + f", or take a checkpoint's adapters with python -m wandistiller.pipeline {run_dir} --out DIR "
            f"--checkpoint {checkpoint}"
        )
    record.ready(run)  # what the format needs at hand (a LoRA student's merged file: its teacher)
    if checkpoint in (None, "ema"):
        final_student(run, checkpoint)  # before any work
    dtype = dtype or record.default_dtype
    request = Request(checkpoint, dtype, name, fp8_layout or "comfy_quant", workflow, card_phrases())
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        with claimed(out) as unchanged, tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
            built = record.write(run, Path(tmp), request)
            unchanged()
            _replace(out, built, Path(tmp))
    except (OSError, SafetensorError) as e:  # a full disk, a quota: safetensors words it "I/O error: …"
        why = (e.strerror or e) if isinstance(e, OSError) else str(e).rsplit(": ", 1)[-1]
        raise UserError(
            f"--out {out}: the export could not be written ({why}); free some space or "
            "choose another folder (nothing was left there)"
        ) from None
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    log.info("exported %s (%s, %s): %.1f MB in %.1f s", out, fmt, dtype or "as saved", size / 1e6,
             time.perf_counter() - start)  # fmt: skip
    return out


@contextlib.contextmanager
def claimed(out: Path) -> Iterator[Callable[[], None]]:
    """`out` held by this export alone from its check to its final rename: made here when new (an empty folder, gone
    again if the export fails), locked (`flock` on the folder itself: a second export into it is refused at once),
    its entries noted. Yields the check made again just before the rename: `out` is still that folder with those
    entries, else nothing is replaced (another process wrote there meanwhile)."""
    made = False
    with contextlib.suppress(FileExistsError):
        out.mkdir()
        made = True
    try:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        _unmade(out, made)
        raise UserError(f"--out {out} cannot be opened as a folder ({e.strerror}); choose a new folder") from None
    try:
        free = flocked(fd, f"--out {out}")
    except UserError:
        os.close(fd)
        _unmade(out, made)
        raise
    if not free:
        os.close(fd)
        raise UserError(
            f"--out {out} is being written by another export; wait for it to finish, or choose another folder"
        )
    inode, entries = os.fstat(fd).st_ino, sorted(os.listdir(fd))

    def unchanged() -> None:
        try:
            now = os.lstat(out).st_ino
            now_entries = sorted(os.listdir(out))
        except OSError:
            now, now_entries = None, []
        if now != inode or now_entries != entries:
            new = sorted(set(now_entries) - set(entries))[:3]
            raise UserError(
                f"--out {out} changed while this export ran (another process wrote there{': ' if new else ''}"
                f"{', '.join(new)}); nothing was replaced: look at it, then export again"
            )

    try:
        yield unchanged
    except BaseException:
        _unmade(out, made)
        raise
    finally:
        os.close(fd)


def _unmade(out: Path, made: bool) -> None:
    """The --out this export made, gone again: only while still empty (whatever another process put there stays)."""
    if made:
        with contextlib.suppress(OSError):
            out.rmdir()


def _replace(out: Path, built: Path, tmp: Path) -> None:
    """`built` takes `out`'s place: an empty folder (or, with --force, a full one) goes only once the export is
    whole, moved aside into the temporary folder first (removed with it)."""

    mask = umask()  # a temporary folder's files are owner-only: give them what a plain write would
    for path in [built, *built.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
    if out.is_dir():
        os.rename(out, tmp / ".replaced")
    os.rename(built, out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m wandistiller.export", description=description(__doc__))
    parser.add_argument("run_dir", type=run_folder_arg, help="a run folder (outputs/<date>/<time>)")
    parser.add_argument("--format", required=True, choices=list(FORMATS), dest="fmt", help="what to write")
    defaults = ", ".join(f"{f.default_dtype or 'as saved (fp32)'} for {f.name}" for f in FORMATS.values())
    fp8 = " or ".join(f.name for f in FORMATS.values() if "fp8" in f.dtypes)
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        help=f"the weights' dtype (default: {defaults}); fp8: ComfyUI's fp8 (--fp8-layout), {fp8} only",
    )
    parser.add_argument(
        "--out", required=True, help="a new folder (or an empty one; --force replaces an earlier export)"
    )
    parser.add_argument(
        "--force", action="store_true", help="replace --out if it holds an earlier export (its model card README.md)"
    )
    parser.add_argument("--checkpoint", help="best, latest, step_N or ema (default: the final student)")
    parser.add_argument("--name", help="the single or LoRA files' name (default: <teacher>_<student>_<dtype>)")
    parser.add_argument(
        "--fp8-layout",
        choices=FP8_LAYOUTS,
        help="--dtype fp8's layout: comfy_quant (default: ComfyUI's per-layer quantization, the rest 16-bit) or "
        "scaled_fp8 (ComfyUI's legacy layout, for builds older than .comfy_quant)",
    )
    parser.add_argument(
        "--workflow",
        choices=list(WORKFLOWS),
        help="the ComfyUI workflow (single-file, lora): "
        + "; ".join(f"{k}: {v}" for k, v in WORKFLOWS.items())
        + " (default: the teacher's own; TI2V 5B takes both)",
    )
    add_teacher_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tool_session(unwind_on_term=True):  # a SIGTERM unwinds: the temporary folder goes
        out = export(
            Path(args.run_dir),
            Path(args.out),
            args.fmt,
            args.dtype,
            args.checkpoint,
            args.force,
            args.name,
            args.fp8_layout,
            args.workflow,
            args.teacher_path,
            args.teacher_lora,
        )
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
