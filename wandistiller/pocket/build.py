"""`python -m wandistiller.pocket.build [--out DIR] [--quick] [--only image|video|i2v]`: rebuild the pocket teachers.

Trains, in order and from fixed seeds: the VAE (AutoencoderKLWan, 32x32 -> 16x8x8), its latent statistics
(`latents_mean` / `latents_std`, as Wan's VAE config carries them), the transformer (WanTransformer3DModel,
rectified flow with CFG dropout) on a random tiny UMT5 text encoder's states (kept frozen: a word-level
tokenizer already makes every prompt distinct), the two experts of `pocket_moe` (the transformer fine-tuned
on t >= 875 and on t < 875), and the judge classifier; then writes both diffusers folders, the classifier and
the training images (a `datasets` folder) under `--out` (default: the package's assets/pocket/). Single-threaded
on the CPU, the same bytes on every run of the same torch build on the same kind of CPU (the float kernels torch
and oneDNN pick differ by instruction set: the shipped image teacher's VAE is matched neither under AVX-512 nor
forced to AVX2 or to no SIMD, docs/QUALITY.md). The video part (`--only video`: pocket_video and its pair, clips of
the digits moving) starts from the image teacher under `--out`; the image-to-video part (`--only i2v`) from the video
teacher.

A stopped build resumes: the same command again takes back each stage it finished (kept under `--out/.stages/`,
pocket/stages.py) and gives the bytes an unbroken build gives. One build at a time writes into `--out`: a second is
one line.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import time
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
from PIL import Image as PILImage

from wandistiller.core.arch import (
    POCKET_MAX_SEQUENCE_LENGTH,
    POCKET_TEXT_ENCODER,
    POCKET_TRANSFORMER,
    POCKET_VAE,
    TINY_I2V_MOE_BOUNDARY_RATIO,
    TINY_MOE_BOUNDARY_RATIO,
)
from wandistiller.core.atomic import flocked
from wandistiller.core.errors import OneLineParser, UserError, description
from wandistiller.core.files import folder_problem, output_problem, run_holding
from wandistiller.pocket import (
    FRAME_CLASSIFIER_FILE,
    I2V_MOE_TEACHER_DIR,
    I2V_PAIRS_DIR,
    I2V_TEACHER_DIR,
    POCKET_DIR,
    VIDEO_MOE_TEACHER_DIR,
    VIDEO_PROMPTS_FILE,
    VIDEO_TEACHER_DIR,
)
from wandistiller.pocket.classifier import save_classifier, train_classifier
from wandistiller.pocket.clips import VIDEO_PROMPTS, rendered_clip_split, video_prompt_file_order
from wandistiller.pocket.digits import PROMPTS, prompt_file_order, rendered_split
from wandistiller.pocket.i2v import POCKET_I2V_TRANSFORMER, clips_for, first_frame_conditions, grown_state
from wandistiller.pocket.stages import Stages, clear_stages, folder_digest, loader, read_model
from wandistiller.pocket.train import latent_moments, train_transformer, train_vae
from wandistiller.pocket.video import (
    POCKET_VIDEO_VAE,
    clip_latents,
    deepened,
    train_frame_judge,
    train_video_decoder,
    train_video_vae,
    video_text_encoder,
    video_tokenizer,
    word_tokenizer,
)
from wandistiller.teacher.vae import latent_stats

log = logging.getLogger("wandistiller.pocket")
# Steps of each part: the full build, and --quick (a smoke test of the whole path, for CI).
STEPS = {"vae": 600, "transformer": 2400, "expert": 300, "classifier": 2000}
QUICK = {"vae": 4, "transformer": 4, "expert": 2, "classifier": 4}


class Phase(NamedTuple):
    """A warm restart: a cosine phase from the last phase's EMA weights. `end_frames`: the first and last latent
    frames' loss weight (they sampled worst); `grow`: blocks whose silent copies are added first (video.deepened)."""

    steps: int
    lr: float
    seed: int
    end_frames: float = 1.0
    grow: tuple[int, ...] = ()


# The video teacher's parts (started from the image teacher's: pocket/video.py).
# "clips": how many of the rendered training clips are encoded (None: all of `copies` renderings of the split).
# "tail": warm restarts: the video transformer was still learning its digits' shapes when a phase ended, then
# plateaued near 88% of frames right at 4 blocks; grown to 6 it reaches 90%, 94% through the fine-tuned decoder
# (docs/QUALITY.md, "Video"). A restart at a lower peak lets the build grow by phases without retraining from the
# image teacher. "decoder": steps of the VAE's decoder alone (video.train_video_decoder: the latents stay the same).
VIDEO_STEPS: dict = dict(
    vae=300,
    decoder=1500,
    transformer=4000,
    tail=(
        Phase(1500, 3e-4, 5),
        Phase(3000, 3e-4, 7),
        Phase(3000, 3e-4, 9),
        Phase(3000, 3e-4, 11, end_frames=2.0),
        Phase(4500, 3e-4, 13, end_frames=2.0),
        Phase(3000, 3e-4, 17, end_frames=2.0, grow=(1, 3)),
    ),
    expert=200,
    classifier=1500,
    batch=64,
    copies=3,
    clips=None,
)
VIDEO_QUICK: dict = dict(
    vae=2,
    decoder=2,
    transformer=2,
    tail=(Phase(1, 3e-4, 5, end_frames=2.0, grow=(1, 3)),),
    expert=1,
    classifier=2,
    batch=4,
    copies=1,
    clips=32,
)
# The image-to-video teacher's (started from the video teacher's: pocket/i2v.py): a cosine phase at the video
# teacher's tail peak, a warm restart, then its two experts at Wan 2.2 I2V A14B's boundary. On the 4-block build the
# restart bought first-frame fidelity (+1.4 dB PSNR), not identity (84% either way); grown from the 6-block video
# teacher it holds the given digit on 91.1% of frames through the fine-tuned decoder (docs/QUALITY.md, "Image to
# video").
I2V_STEPS: dict = dict(
    transformer=1500, lr=3e-4, tail=(Phase(3000, 3e-4, 5),), expert=200, batch=64, copies=3, clips=None
)
I2V_QUICK: dict = dict(transformer=2, lr=3e-4, expert=1, batch=4, copies=1, clips=32)
PARTS = ("image", "video", "i2v")
LOCK_FILE = ".build.lock"


def build_tokenizer():
    """Word-level over the pocket prompts' words; T5-like specials (pad=0, eos=1, unk=2)."""
    words = sorted({w for p in PROMPTS for w in p.split()})
    return word_tokenizer({"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}})


# Each stage of a build is one of these functions called with every argument it follows from (pocket/stages.py keys
# the stage by them and by the function's code): nothing a stage's weights depend on is set outside the call.


def new_vae(images: torch.Tensor, steps: int, config: dict = POCKET_VAE, seed: int = 1):
    """The image teacher's VAE, trained from scratch on `images`."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return train_vae(AutoencoderKLWan(**config), images, steps)


def video_vae(image_vae, steps: int, config: dict = POCKET_VIDEO_VAE, seed: int = 6):
    """The video VAE: the image VAE's weights (the same layout, all of them) fine-tuned on clips."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(**config)
    vae.load_state_dict(image_vae.state_dict())
    return train_video_vae(vae, steps)


def first_phase(
    config: dict, start: dict | None, latents, cond, uncond, steps: int, batch: int, lr: float, condition, seed: int = 2
):
    """A teacher's first training phase: a transformer of `config` (from `start`'s weights where given)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    first = WanTransformer3DModel(**config)
    if start is not None:
        first.load_state_dict(start)
    return train_transformer(first, latents, cond, uncond, steps, batch=batch, lr=lr, condition=condition)


def restart(phase: Phase, transformer, latents, cond, uncond, batch: int, condition):
    """A warm restart: the last phase's EMA weights (grown first where the phase says) go on training with their own
    fresh optimiser and EMA, as a run resumed from them would."""
    transformer = deepened(transformer, phase.grow) if phase.grow else transformer
    return train_transformer(
        transformer.requires_grad_(True),
        latents,
        cond,
        uncond,
        phase.steps,
        batch=batch,
        lr=phase.lr,
        seed=phase.seed,
        condition=condition,
        end_frames=phase.end_frames,
    )


def fine_tuned(
    transformer, latents, cond, uncond, steps: int, t_range, batch: int, lr: float, seed: int, condition, end_frames
):
    """An expert: `transformer` fine-tuned on its share of the timesteps (`t_range`)."""
    expert = copy.deepcopy(transformer).requires_grad_(True)
    return train_transformer(
        expert,
        latents,
        cond,
        uncond,
        steps,
        t_range,
        batch=batch,
        lr=lr,
        seed=seed,
        condition=condition,
        end_frames=end_frames,
    )


def base_pipeline(vae_steps: int, images: torch.Tensor, stages: Stages):
    """WanPipeline with tokenizer, text encoder, trained VAE (its latent statistics set) and scheduler."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **POCKET_TEXT_ENCODER)).eval()

    vae = stages("vae", partial(new_vae, images, vae_steps), loader(AutoencoderKLWan))
    z = latent_moments(vae, images)
    # One std for all channels (Wan's VAE has one per channel): a channel the digits hardly use then stays
    # near zero instead of being blown up to unit variance, and the transformer need not model its noise.
    mean, std = z.mean((0, 2, 3, 4)), (z - z.mean((0, 2, 3, 4), keepdim=True)).std().expand(z.shape[1])
    vae.register_to_config(
        latents_mean=[round(float(m), 5) for m in mean], latents_std=[round(float(s), 5) for s in std]
    )
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    )
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=None)


@torch.no_grad()
def text_states(pipe, prompts: list[str]) -> torch.Tensor:
    """[N, 16, D] states exactly as WanPipeline.encode_prompt pads them at the pocket's sequence length."""
    length, cpu = POCKET_MAX_SEQUENCE_LENGTH, torch.device("cpu")
    states, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=length, device=cpu)
    return states


def normalised_latents(vae, images: torch.Tensor) -> torch.Tensor:

    mean, std = latent_stats(vae)
    return (latent_moments(vae, images) - mean) / std


def train_experts(
    steps: dict,
    latents,
    cond,
    uncond,
    stages: Stages,
    start: dict | None = None,
    batch: int = 128,
    config: dict = POCKET_TRANSFORMER,
    condition: torch.Tensor | None = None,
    boundary_ratio: float = TINY_MOE_BOUNDARY_RATIO,
):
    """(transformer, (high-noise expert, low-noise expert)), each from fixed seeds; the transformer from
    `start`'s weights where given (the video teacher starts from the image teacher's, the I2V teacher from the
    video teacher's); `condition`: an image-to-video teacher's per-clip conditioning (train.flow_batch). The first
    phase, each warm restart and each expert is one of `stages`."""
    from diffusers import WanTransformer3DModel

    load, lr = loader(WanTransformer3DModel), steps.get("lr", 1e-3)
    data = (latents, cond, uncond)
    first = partial(first_phase, config, start, *data, steps["transformer"], batch, lr, condition)
    transformer = stages("transformer", first, load)
    tail = steps.get("tail", ())
    for i, phase in enumerate(tail, 1):
        transformer = stages(f"phase{i}", partial(restart, phase, transformer, *data, batch, condition), load)
    end_frames = tail[-1].end_frames if tail else 1.0  # the experts train as the last phase weighed the end frames
    experts = expert_pair(
        transformer, latents, cond, uncond, steps["expert"], batch, stages, end_frames, condition, boundary_ratio
    )
    return transformer, experts


EXPERT_LR = 3e-4  # each expert's fine-tune's peak


def expert_pair(
    transformer,
    latents,
    cond,
    uncond,
    steps: int,
    batch: int,
    stages: Stages,
    end_frames: float = 1.0,
    condition: torch.Tensor | None = None,
    boundary_ratio: float = TINY_MOE_BOUNDARY_RATIO,
):
    """(high-noise expert, low-noise expert): `transformer` fine-tuned on each one's share of the timesteps, from
    fixed seeds, with the last phase's objective (`end_frames`, `condition`: train_transformer); each one of
    `stages`."""
    from diffusers import WanTransformer3DModel

    boundary, load = boundary_ratio * 1000, loader(WanTransformer3DModel)
    experts = []
    for name, seed, t_range in (("expert_high", 3, (boundary, 1000.0)), ("expert_low", 4, (0.0, boundary))):
        args = (transformer, latents, cond, uncond, steps, t_range, batch, EXPERT_LR, seed, condition, end_frames)
        experts.append(stages(name, partial(fine_tuned, *args), load))
    return tuple(experts)


def save_train_images(out: Path) -> None:
    """The training split rendered once (seed 0), as a `datasets` folder for data=pocket_digits."""
    from datasets import Dataset, Image

    images, *_, prompts = rendered_split("train", copies=1, seed=0)
    pil = [PILImage.fromarray((im.permute(1, 2, 0) * 255).round().byte().numpy()) for im in images]
    folder = out / "digits_train"
    shutil.rmtree(folder, ignore_errors=True)
    Dataset.from_dict({"image": pil, "text": prompts}).cast_column("image", Image()).save_to_disk(str(folder))


def build(out: Path, steps: dict) -> dict:
    """Train every part and write them under `out`; returns the seconds each part took."""
    from diffusers import WanPipeline

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    clock, times = time.perf_counter(), {}
    stages = Stages(out, "image")
    images, *_, prompts = rendered_split("train", copies=4, seed=1)
    pipe = base_pipeline(steps["vae"], images, stages)
    times["vae_s"] = time.perf_counter() - clock
    latents = normalised_latents(pipe.vae, images)
    table = text_states(pipe, PROMPTS)
    cond = table[torch.tensor([PROMPTS.index(p) for p in prompts])]
    uncond = text_states(pipe, [""])
    transformer, (high, low) = train_experts(steps, latents, cond, uncond, stages)
    times["transformers_s"] = time.perf_counter() - clock - times["vae_s"]
    parts = dict(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae, scheduler=pipe.scheduler)
    for name, kwargs in (
        ("pocket-wan-t2v", dict(transformer=transformer)),
        ("pocket-wan-t2v-moe", dict(transformer=high, transformer_2=low, boundary_ratio=TINY_MOE_BOUNDARY_RATIO)),
    ):
        shutil.rmtree(out / name, ignore_errors=True)
        WanPipeline(**parts, **kwargs).save_pretrained(out / name, safe_serialization=True)
    save_classifier(train_classifier(steps["classifier"]), out / "classifier.safetensors")
    save_train_images(out)
    (out / "prompts.txt").write_text("\n".join(prompt_file_order()) + "\n")
    times["total_s"] = time.perf_counter() - clock
    return times


def build_video(out: Path, steps: dict) -> dict:
    """The video teacher and its pair from the image teacher under `out` (built first); returns seconds per part."""
    from diffusers import AutoencoderKLWan, WanPipeline

    torch.set_num_threads(1)
    clock, times = time.perf_counter(), {}
    stages = Stages(out, "video", folder_digest(out / "pocket-wan-t2v"))
    image = WanPipeline.from_pretrained(out / "pocket-wan-t2v")
    tokenizer = video_tokenizer(image.tokenizer)
    text_encoder = video_text_encoder(image.text_encoder, len(tokenizer))

    load = loader(AutoencoderKLWan)
    vae = stages("video_vae", partial(video_vae, image.vae, steps["vae"]), load)
    # its decoder alone, the encoder frozen: the latents below are the same
    vae = stages("video_decoder", partial(train_video_decoder, vae, steps["decoder"]), load)
    times["video_vae_s"] = time.perf_counter() - clock
    clips, _, prompts = rendered_clip_split("train", copies=steps["copies"], seed=1)
    clips, prompts = clips[: steps["clips"]], prompts[: steps["clips"]]
    z = clip_latents(vae, clips)
    del clips
    mean, std = z.mean((0, 2, 3, 4)), (z - z.mean((0, 2, 3, 4), keepdim=True)).std().expand(z.shape[1])
    vae.register_to_config(
        latents_mean=[round(float(m), 5) for m in mean], latents_std=[round(float(s), 5) for s in std]
    )
    lat_mean, lat_std = latent_stats(vae)
    latents = (z - lat_mean) / lat_std
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=image.scheduler, transformer=None
    )
    table = text_states(pipe, VIDEO_PROMPTS)
    cond = table[torch.tensor([VIDEO_PROMPTS.index(p) for p in prompts])]
    uncond = text_states(pipe, [""])
    transformer, (high, low) = train_experts(
        steps, latents, cond, uncond, stages, start=image.transformer.state_dict(), batch=steps["batch"]
    )
    times["video_transformers_s"] = time.perf_counter() - clock - times["video_vae_s"]
    parts = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=image.scheduler)
    for name, kwargs in (
        (VIDEO_TEACHER_DIR.name, dict(transformer=transformer)),
        (VIDEO_MOE_TEACHER_DIR.name, dict(transformer=high, transformer_2=low, boundary_ratio=TINY_MOE_BOUNDARY_RATIO)),
    ):
        shutil.rmtree(out / name, ignore_errors=True)
        WanPipeline(**parts, **kwargs).save_pretrained(out / name, safe_serialization=True)
    save_classifier(train_frame_judge(steps["classifier"]), out / FRAME_CLASSIFIER_FILE.name)
    (out / VIDEO_PROMPTS_FILE.name).write_text("\n".join(video_prompt_file_order()) + "\n")
    times["video_total_s"] = time.perf_counter() - clock
    return times


def save_i2v_pairs(out: Path) -> None:
    """One first frame per video prompt (the prompts file's order: its last 10% a run's validation pairs), each
    rendered from a training digit of the prompt's class, as a `datasets` folder for data=image_folder."""
    from datasets import Dataset, Image

    prompts = video_prompt_file_order()
    frames = clips_for(prompts, "train", seed=21)[:, 0]
    pil = [PILImage.fromarray((f.permute(1, 2, 0) * 255).round().byte().numpy()) for f in frames]
    folder = out / I2V_PAIRS_DIR.name
    shutil.rmtree(folder, ignore_errors=True)
    Dataset.from_dict({"image": pil, "text": prompts}).cast_column("image", Image()).save_to_disk(str(folder))


def build_i2v(out: Path, steps: dict) -> dict:
    """The image-to-video teacher and its A14B-layout pair from the video teacher under `out` (built first)."""
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanPipeline

    torch.set_num_threads(1)
    clock, times = time.perf_counter(), {}
    stages = Stages(out, "i2v", folder_digest(out / VIDEO_TEACHER_DIR.name))
    video = WanPipeline.from_pretrained(out / VIDEO_TEACHER_DIR.name)
    video.vae = read_model(AutoencoderKLWan, out / VIDEO_TEACHER_DIR.name / "vae")  # saved below: no path in its config
    clips, _, prompts = rendered_clip_split("train", copies=steps["copies"], seed=1)
    clips, prompts = clips[: steps["clips"]], prompts[: steps["clips"]]
    lat_mean, lat_std = latent_stats(video.vae)
    latents = (clip_latents(video.vae, clips) - lat_mean) / lat_std
    condition = first_frame_conditions(video.vae, clips)
    del clips
    table = text_states(video, VIDEO_PROMPTS)
    cond = table[torch.tensor([VIDEO_PROMPTS.index(p) for p in prompts])]
    uncond = text_states(video, [""])
    transformer, (high, low) = train_experts(
        steps,
        latents,
        cond,
        uncond,
        stages,
        start=grown_state(video.transformer.state_dict()),
        batch=steps["batch"],
        config=POCKET_I2V_TRANSFORMER | {"num_layers": video.transformer.config.num_layers},
        condition=condition,
        boundary_ratio=TINY_I2V_MOE_BOUNDARY_RATIO,
    )
    times["i2v_transformers_s"] = time.perf_counter() - clock
    parts = dict(tokenizer=video.tokenizer, text_encoder=video.text_encoder, vae=video.vae, scheduler=video.scheduler)
    for name, kwargs in (
        (I2V_TEACHER_DIR.name, dict(transformer=transformer)),
        (
            I2V_MOE_TEACHER_DIR.name,
            dict(transformer=high, transformer_2=low, boundary_ratio=TINY_I2V_MOE_BOUNDARY_RATIO),
        ),
    ):
        shutil.rmtree(out / name, ignore_errors=True)
        WanImageToVideoPipeline(**parts, **kwargs).save_pretrained(out / name, safe_serialization=True)
    save_i2v_pairs(out)
    times["i2v_total_s"] = time.perf_counter() - clock
    return times


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="python -m wandistiller.pocket.build", description=description(__doc__))
    parser.add_argument(
        "--out",
        type=Path,
        default=POCKET_DIR,
        help="where to write (default: the package's); the same command again resumes a stopped build from the stages "
        "it kept there",
    )
    parser.add_argument("--quick", action="store_true", help="a few steps of each part (a smoke test)")
    parser.add_argument(
        "--only",
        choices=PARTS,
        help="one teacher: image (pocket, pocket_moe, the judge, the images), video (pocket_video, "
        "pocket_video_moe, the frame judge; started from the image teacher already under --out) or i2v "
        "(pocket_i2v, pocket_i2v_moe, their image-prompt pairs; started from the video teacher under --out)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    problem = folder_problem(args.out) or output_problem(args.out.parent)  # tried before 17 minutes of training
    run = run_holding(args.out)  # teachers were written into a finished run
    problem = problem or (f"it is or lies in the run folder {run}, whose files are the run's" if run else None)
    if problem:
        parser.error(f"--out {args.out}: {problem}; choose another folder")
    if args.only == "video" and not (args.out / "pocket-wan-t2v" / "model_index.json").is_file():
        parser.error(f"--only video: no image teacher under {args.out}/pocket-wan-t2v; build it first (--only image)")
    if args.only == "i2v" and not (args.out / VIDEO_TEACHER_DIR.name / "model_index.json").is_file():
        parser.error(
            f"--only i2v: no video teacher under {args.out}/{VIDEO_TEACHER_DIR.name}; build it first (--only video)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    held = _build_lock(args.out, parser)
    try:
        times = build_parts(args.out, args.only, args.quick)
    finally:
        os.close(held)
    print(" ".join(f"{k}={v:.0f}" for k, v in times.items()), f"-> {args.out}")


def _build_lock(out: Path, parser: OneLineParser) -> int:
    """The build's hold on `out` (its `.build.lock`, kept: removing it could let two builds lock two files), let go
    when the build ends or its process dies; one line where another build holds it (the two would train over each
    other's stages and replace each other's folders). Opened read-only: another user's lock file locks as well. A
    file system without locks (some network mounts) builds unguarded, and says so; a lock file that cannot be
    opened (a folder or a link in its place) is one line, never a build left unguarded."""
    lock = out / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        parser.error(f"--out {out}: its lock file {LOCK_FILE} cannot be opened ({e.strerror}); remove {lock}")
    try:
        free = flocked(fd, f"--out {out}: its lock file {LOCK_FILE}")
    except UserError as e:
        os.close(fd)
        parser.error(str(e))
    if not free:
        os.close(fd)
        parser.error(f"--out {out}: another build is writing there; wait for it, or choose another folder")
    return fd


def build_parts(out: Path, only: str | None, quick: bool) -> dict[str, float]:
    """The parts asked for, in order (each starts from the one before it under `out`); seconds per part."""
    times: dict[str, float] = {}
    parts = [part for part in PARTS if only in (None, part)]
    if "image" in parts:
        times |= build(out, QUICK if quick else STEPS)
    if "video" in parts:
        times |= build_video(out, VIDEO_QUICK if quick else VIDEO_STEPS)
    if "i2v" in parts:
        times |= build_i2v(out, I2V_QUICK if quick else I2V_STEPS)
    # Kept until every part asked for is written: a build stopped in its video part went on from its image stages.
    clear_stages(out, parts)
    return times


if __name__ == "__main__":
    main()
