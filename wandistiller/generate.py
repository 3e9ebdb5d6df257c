"""`python -m wandistiller.generate <run_dir or student folder> --prompt "…"`: images from the student.

The student samples through diffusers' WanPipeline in the teacher's place, with the teacher's text encoder and
VAE, without CFG, at its own steps: a KD student with the teacher's scheduler at --steps, a few-step student with
its few-step scheduler at its K (--student-steps N: another count); `--teacher` writes the teacher's image (its
CFG and scheduler at --steps) from the same noise beside it. Each image is named by its prompt, seed and who drew
it, with every setting that changes it and is not the default (`image_name`): `a-fox_seed0_student.png` at the
student's own steps, `a-fox_seed0_student1.png` at 1, `a-fox_seed0_student_best.png` for a checkpoint,
`a-fox_seed0_teacher4.png` at --steps 4, so no image overwrites one drawn otherwise.

A student of an image-to-video teacher continues a given first frame: `--image PATH` (one for every prompt, or one
per prompt), scaled down and center-cropped to the run's frame size as its data source fitted its images, sampled
through the model's own WanImageToVideoPipeline (TI2V 5B's may go without: it is then a text-to-video model).
"""

from __future__ import annotations

import argparse
import hashlib
import re
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from wandistiller.compose import register_configs
from wandistiller.core.arch import Layout
from wandistiller.core.errors import (
    OneLineParser,
    UserError,
    description,
    whole_number,
)
from wandistiller.core.files import in_run, out_folder_problem, output_problem, overlap, run_holding, write_in_run
from wandistiller.core.precision import DTYPES, to_dtype
from wandistiller.core.stopping import tool_session
from wandistiller.data.conditions import fitted, frame_size, unreadable
from wandistiller.data.prompts import encode_prompts
from wandistiller.evaluation.grids import save_clip
from wandistiller.state.runs import (
    check_frames,
    check_teacher_fits,
    given_run_folder,
    open_run,
    other_teacher_tag,
    student_sampler,
    student_scheduler,
    student_source,
)
from wandistiller.state.sampling import check_counts, generate, load_teacher
from wandistiller.state.trust import Trust, add_trust_args
from wandistiller.student.lora import is_lora_folder
from wandistiller.teacher.image import load_image_encoder
from wandistiller.teacher.spec import read_json
from wandistiller.teacher.vae import decode_clips, decode_latents, load_vae


def locate(path: str, checkpoint: str | None, trust: Trust | None = None):
    """(run folder, student source): a run folder, or a saved student folder inside one (`<run>/student`)."""
    path_, opened = given_run_folder(path), (trust or Trust()).open_args()
    register_configs()  # the registries' options, which the run's config may name

    # (a LoRA student's folder holds its adapters, no config.json)
    if ((path_ / "config.json").is_file() or is_lora_folder(path_)) and not (path_ / ".hydra").is_dir():
        run = open_run(path_.parent, *opened) if (path_.parent / ".hydra").is_dir() else None
        if run is None:
            raise UserError(f"{path} is a student folder outside a run folder; give its run folder instead")
        return run, path_
    run = open_run(path_, *opened)
    return run, student_source(run, checkpoint)


# The run's own folders, each written by training and read by the tools (an audit wrote pictures into .hydra/ and
# pipeline/transformer/): --out is refused in them. Its default, generated/, and a folder of the user's may hold them.
RUNS_OWN = {
    "student": "the run's student",
    "student_ema": "the run's EMA student",
    "checkpoints": "the run's checkpoints",
    "pipeline": "the run's pipeline",
    ".hydra": "the run's saved config",
    "samples": "the run's sample grids",
    "wandb": "the run's wandb folder",
    "tensorboard": "the run's tensorboard folder",
}


def _among_inputs(out: Path, run) -> str | None:
    """Why `--out` would write pictures among what a run is read from, in words: the teacher's folder (a model
    folder, or the package's own pocket teacher), one of the run's own folders; None where it does not."""
    places = [("the teacher's folder", Path(run.spec.path))] + [(w, run.path / n) for n, w in RUNS_OWN.items()]
    other = run_holding(out)  # another run's own folders too: its resume replaces student/, prunes checkpoints/
    if other is not None and other.resolve() != run.path.resolve():
        places += [(w.replace("the run's", "another run's"), other / n) for n, w in RUNS_OWN.items()]
    for what, place in places:
        if overlap(out, place) in ("is", "is inside"):  # a folder holding them is written beside them, not in
            return f"{out} is {what} or inside it ({place}), which are read, not written to"
    return None


def write_images(
    latents: torch.Tensor, vae, prompts: list[str], out: Path, who: str, seed: int, given: list[str] | None = None
) -> list[Path]:
    """One PNG per prompt; for a clip run (latents of more than one frame) a GIF each and its still strip PNG.
    `given`: each prompt's --image's `image_tag`, named in its file (`<slug>_<image>_seed…`): another first frame
    for the same prompt was written over the first one's clip."""
    if latents.shape[2] > 1:
        return write_clips(latents, vae, prompts, out, who, seed, given)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for img, slug in zip(decode_latents(vae, latents), prompt_slugs(prompts, given)):
        image = Image.fromarray((img.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
        # written whole: a link in its place (a received run's generated/x.png -> a file of yours) is replaced
        name = image_name(slug, seed, who)
        paths.append(write_in_run(out, name, write=lambda f, im=image: im.save(f, format="png")))
    return paths


def write_clips(
    latents: torch.Tensor, vae, prompts: list[str], out: Path, who: str, seed: int, given: list[str] | None = None
) -> list[Path]:
    """`<slug>_seed<seed>_<who>.gif` (the clip, its prompt above) and `.png` (its frames in a row) per prompt."""
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for clip, prompt, slug in zip(decode_clips(vae, latents), prompts, prompt_slugs(prompts, given)):
        name = Path(image_name(slug, seed, who)).with_suffix(".gif")
        paths += save_clip(clip.permute(0, 2, 3, 1).numpy(), prompt, name, out)
    return paths


def prompt_slugs(prompts: list[str], given: list[str] | None = None) -> list[str]:
    """Each prompt's short name: at most 48 letters and digits of it, joined by `-`; where that loses something of
    the prompt (capitals, punctuation, other scripts, its length past 48), a digest of the whole prompt after it, so
    that a later call's prompt that reads the same so (`A fox!` after `a fox`, two long prompts alike for 48
    letters, any two in Japanese) never replaces this one's image. One prompt given twice in a call (each drawn
    from its own noise) gets `+2`, `+3`, ... after the first. `given`: each prompt's `image_tag`, after the
    prompt's."""
    slugs: list[str] = []
    for i, prompt in enumerate(prompts):
        slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:48] or "prompt"
        if "-" in prompt or slug.replace("-", " ") != prompt:
            slug += "-" + hashlib.sha256(prompt.encode()).hexdigest()[:6]
        if given is not None:
            slug += "_" + given[i]
        name, n = slug, 1
        while name in slugs:  # `+`: no prompt's slug has it, so `a fox` twice never takes the name of `a fox 2`
            n += 1
            name = f"{slug}+{n}"
        slugs.append(name)
    return slugs


def image_tag(path: str, picture: Image.Image) -> str:
    """A given first frame's part of a file name: its file's name and a digest of the frame it gives, so that
    another image of the same name (x.png of another folder, a name of letters a slug drops) never replaces it."""
    stem = re.sub(r"[^a-z0-9]+", "-", Path(path).stem.lower()).strip("-")[:32] or "image"
    return f"{stem}-{hashlib.sha256(picture.tobytes()).hexdigest()[:8]}"


STEPS = 20  # --steps unasked: the teacher's, and a KD student's
MAX_SEED = 2**63 - 1  # a seed of any size draws its own noise (hashed); it is bounded for the images' names


def image_name(slug: str, seed: int, who: str) -> str:
    """`<prompt slug>_seed<seed>_<who>.png`; `who` is `drawn_by`'s."""
    return f"{slug}_seed{seed}_{who}.png"


def drawn_by(
    who: str,
    steps: int,
    own_steps: int,
    source: Path | None = None,
    dtype: str | None = None,
    teacher: str | None = None,
) -> str:
    """Who drew an image and how, where it is not the default: `student` at its own steps (a few-step student's
    K, a KD student's --steps 20), else `student1`; a checkpoint's `_best`/`_step_XXXXXXXX`/`_ema`; a --dtype other
    than the run's `_bf16`; a teacher other than the recorded one (--allow-other-teacher) `_teacher-<digest>`. The
    final student at its own steps keeps the name it always had."""
    name = who + (str(steps) if steps != own_steps else "")
    if source is not None and source.name != "student":
        name += f"_{source.name.removeprefix('student_')}"  # student_ema/: `_ema`
    return name + (f"_{dtype}" if dtype else "") + (f"_{teacher}" if teacher else "")


def run_generate(args: argparse.Namespace, device: torch.device | None = None) -> list[Path]:

    run, source = locate(args.path, args.checkpoint, Trust.from_args(args))
    check_frames(run)  # a clip run against an image teacher, or the reverse: one line before any work
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = to_dtype(args.dtype or run.cfg.precision.teacher_dtype, "--dtype")
    check_teacher_fits(run, source, args.allow_other_teacher)
    pictures = first_frames(args, run)  # each checked, before any work
    judged = other_teacher_tag(run, source, args.allow_other_teacher)  # its own file names: see drawn_by
    check_counts(
        run,
        {"--steps": args.steps, "--student-steps": args.student_steps or 1},
        len(args.prompt) * (2 if args.teacher else 1),
        f"{len(args.prompt)} prompts",
    )
    idx, out = list(range(len(args.prompt))), Path(args.out) if args.out else in_run(run.path, "generated")
    problem = (output_problem(out) or _among_inputs(out, run)) if args.out else output_problem(run.path, "generated")
    if problem:  # before any work (the prompts' encoding, minutes of sampling), not after
        raise UserError(f"--out: {problem}; choose another folder")
    problem = out_folder_problem(out, "each prompt, seed and model gets a file of its own in it")
    if problem:  # `--out fox.png` made a folder named fox.png
        raise UserError(problem)
    t_cfg = run.cfg.teacher
    emb = encode_prompts(
        run.spec, args.prompt, t_cfg.negative_prompt, t_cfg.max_sequence_length, dtype, device, run.cfg.paths.cache_dir
    )
    vae = load_vae(run.spec, device)
    images = None if pictures is None else (vae, load_image_encoder(run.spec, device), lambda i, _k: pictures[i])
    student = student_sampler(run, source, device)
    trained = run.trained_steps
    steps = args.student_steps or trained or args.steps  # its own K, unless told otherwise
    # --dtype named only where it is not the run's: the default's images keep their names
    other = (
        {v: k for k, v in DTYPES.items()}[dtype] if DTYPES.get(str(run.cfg.precision.teacher_dtype)) != dtype else None
    )
    latents, _ = generate(
        student,
        emb,
        idx,
        args.seed,
        steps,
        run.latent_shape,
        scheduler=student_scheduler(run.spec, trained, steps, run.trained_schedule),
        images=images,
    )
    who = drawn_by("student", steps, trained or STEPS, source, other, judged)
    given = None if pictures is None else [image_tag(args.image[0 if len(args.image) == 1 else i], p) for i, p in
                                           zip(idx, pictures)]  # fmt: skip
    paths = write_images(latents, vae, args.prompt, out, who, args.seed, given)
    if args.teacher:
        teacher = load_teacher(run, device, dtype)
        latents, _ = generate(teacher, emb, idx, args.seed, args.steps, run.latent_shape, images=images)
        who = drawn_by("teacher", args.steps, STEPS, None, other, judged)
        paths += write_images(latents, vae, args.prompt, out, who, args.seed, given)
    return paths


def first_frames(args: argparse.Namespace, run) -> list[Image.Image] | None:
    """Each prompt's first frame from --image (one for every prompt, or one per prompt), checked and fitted to the
    run's frames as its data source fits a given image (data/conditions.py); None where none is given (a TI2V
    student then samples text to video). Wrong for the run's teacher: one line."""
    layout = run.spec.layout
    if not args.image:
        if layout == Layout.i2v:
            raise UserError(
                "--image: a student of an image-to-video teacher continues a given first frame; give --image PATH "
                "(one for every --prompt, or one per --prompt)"
            )
        return None
    if layout == Layout.t2v:
        raise UserError("--image: this run's teacher is conditioned on its prompt alone, not an image; drop --image")
    if len(args.image) not in (1, len(args.prompt)):
        raise UserError(
            f"--image: {len(args.image)} images for {len(args.prompt)} prompts; give one for every prompt, or one "
            "per prompt in the same order"
        )
    vae_config = read_json(run.spec.path / "vae" / "config.json", "teacher.path")
    height, width = frame_size(run.cfg.data, vae_config)
    pictures = []
    for path in args.image:
        file = Path(path).expanduser()
        if not file.is_file():
            what = "is a folder" if file.is_dir() else "does not exist"
            raise UserError(f"--image {path} {what}; give an image file (PNG, JPEG or WebP)")
        try:
            with Image.open(file) as opened:
                opened.load()
                pictures.append(fitted(opened, height, width, path, "--image"))
        except UserError:
            raise
        except Exception as e:  # PIL raises many types for a missing or damaged file; all mean the same to the user
            if isinstance(e, Image.DecompressionBombError):  # a large valid image: not "not readable"
                raise UserError(f"--image {path} {unreadable(e)}") from None
            raise UserError(f"--image {path}: not a readable image file; give a PNG, JPEG or WebP") from None
    return pictures * len(args.prompt) if len(pictures) == 1 else pictures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; a step count that is not a whole number of 1 or more (or a seed that is no whole number)
    is one `error:` line (UserError), as every refusal of argparse's is (OneLineParser)."""
    parser = OneLineParser(prog="python -m wandistiller.generate", description=description(__doc__))
    parser.add_argument("path", help="a run folder, or its saved student folder (<run>/student)")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    parser.add_argument(
        "--steps",
        metavar="N",
        default=str(STEPS),
        help=f"sampling steps of a KD student and the teacher (default {STEPS})",
    )
    parser.add_argument(
        "--student-steps",
        metavar="N",
        help="the student's steps (default: a few-step student's own K, a KD student --steps)",
    )
    parser.add_argument(
        "--image",
        action="append",
        metavar="PATH",
        help="an image-to-video student's first frame: one for every prompt, or one per --prompt (repeat)",
    )
    parser.add_argument("--seed", metavar="N", default="0", help="noise seed (default 0)")
    parser.add_argument("--teacher", action="store_true", help="also write the teacher's image from the same noise")
    parser.add_argument("--checkpoint", help="best, latest, step_N or ema (default: the final student, else latest)")
    parser.add_argument("--out", help="output folder (default <run>/generated)")
    parser.add_argument(
        "--dtype", choices=["fp32", "bf16", "fp16"], help="teacher/text-encoder dtype (default: the run's)"
    )
    add_trust_args(parser)
    args = parser.parse_args(argv)
    args.steps = whole_number(str(args.steps), "--steps", example=STEPS)
    if args.student_steps is not None:
        args.student_steps = whole_number(str(args.student_steps), "--student-steps")
    args.seed = whole_number(str(args.seed), "--seed", least=None, example=0)
    if abs(args.seed) > MAX_SEED:  # it names every image: a longer one is no file name the system can make
        digits = len(str(abs(args.seed)))
        raise UserError(f"--seed is {digits} digits long; give a whole number from -{MAX_SEED} to {MAX_SEED}")
    return args


ON_STOP = "images already written are kept; run it again for the rest"  # what a SIGTERM or Ctrl-C leaves


def main(argv: list[str] | None = None) -> None:
    with tool_session(stop=ON_STOP):
        args = parse_args(argv)
        for path in run_generate(args):
            print(path)


if __name__ == "__main__":
    main()
