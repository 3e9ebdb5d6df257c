"""`python -m wandistiller.pocket.build [--out DIR] [--quick]`: rebuild the pocket teachers from the digits.

Trains, in order and from fixed seeds: the VAE (AutoencoderKLWan, 32x32 -> 16x8x8), its latent statistics
(`latents_mean` / `latents_std`, as Wan's VAE config carries them), the transformer (WanTransformer3DModel,
rectified flow with CFG dropout) on a random tiny UMT5 text encoder's states (kept frozen: a word-level
tokenizer already makes every prompt distinct), the two experts of `pocket_moe` (the transformer fine-tuned
on t >= 875 and on t < 875), and the judge classifier; then writes both diffusers folders, the classifier and
the training images (a `datasets` folder) under `--out` (default: the package's assets/pocket/). Single-threaded
on the CPU, the same bytes on every run of the same torch build.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch
from PIL import Image as PILImage
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from wandistiller.core.arch import (
    POCKET_MAX_SEQUENCE_LENGTH,
    POCKET_TEXT_ENCODER,
    POCKET_TRANSFORMER,
    POCKET_VAE,
    TINY_MOE_BOUNDARY_RATIO,
)
from wandistiller.core.errors import OneLineParser, description
from wandistiller.pocket import POCKET_DIR
from wandistiller.pocket.classifier import save_classifier, train_classifier
from wandistiller.pocket.digits import PROMPTS, prompt_file_order, rendered_split
from wandistiller.pocket.train import latent_moments, train_transformer, train_vae
from wandistiller.teacher.vae import latent_stats

log = logging.getLogger("wandistiller.pocket")
# Steps of each part: the full build, and --quick (a smoke test of the whole path, for CI).
STEPS = {"vae": 600, "transformer": 2400, "expert": 300, "classifier": 2000}
QUICK = {"vae": 4, "transformer": 4, "expert": 2, "classifier": 4}


def build_tokenizer():
    """Word-level over the pocket prompts' words; T5-like specials (pad=0, eos=1, unk=2)."""
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for p in PROMPTS for w in p.split()})
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=POCKET_MAX_SEQUENCE_LENGTH,
    )


def base_pipeline(vae_steps: int, images: torch.Tensor):
    """WanPipeline with tokenizer, text encoder, trained VAE (its latent statistics set) and scheduler."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **POCKET_TEXT_ENCODER)).eval()
    torch.manual_seed(1)
    vae = train_vae(AutoencoderKLWan(**POCKET_VAE), images, vae_steps)
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


def train_experts(steps: dict, latents, cond, uncond):
    """(transformer, (high-noise expert, low-noise expert)), each from fixed seeds."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(2)
    transformer = train_transformer(
        WanTransformer3DModel(**POCKET_TRANSFORMER), latents, cond, uncond, steps["transformer"]
    )
    boundary = TINY_MOE_BOUNDARY_RATIO * 1000
    experts = []
    for seed, t_range in ((3, (boundary, 1000.0)), (4, (0.0, boundary))):
        start = WanTransformer3DModel(**POCKET_TRANSFORMER)
        start.load_state_dict(transformer.state_dict())
        experts.append(train_transformer(start, latents, cond, uncond, steps["expert"], t_range, lr=3e-4, seed=seed))
    return transformer, experts


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
    images, *_, prompts = rendered_split("train", copies=4, seed=1)
    pipe = base_pipeline(steps["vae"], images)
    times["vae_s"] = time.perf_counter() - clock
    latents = normalised_latents(pipe.vae, images)
    table = text_states(pipe, PROMPTS)
    cond = table[torch.tensor([PROMPTS.index(p) for p in prompts])]
    uncond = text_states(pipe, [""])
    transformer, (high, low) = train_experts(steps, latents, cond, uncond)
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


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="python -m wandistiller.pocket.build", description=description(__doc__))
    parser.add_argument("--out", type=Path, default=POCKET_DIR, help="where to write (default: the package's)")
    parser.add_argument("--quick", action="store_true", help="a few steps of each part (a smoke test)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    times = build(args.out, QUICK if args.quick else STEPS)
    print(" ".join(f"{k}={v:.0f}" for k, v in times.items()), f"-> {args.out}")


if __name__ == "__main__":
    main()
