"""A "style" LoRA of the pocket teacher: every digit drawn dim, at half its brightness, which a statistic measures.

`python -m wandistiller.pocket.style [--out FILE] [--quick]` fine-tunes low-rank adapters on the image teacher
(`teacher=pocket`) with the teacher's own objective (rectified flow at its shift, 10% of prompts dropped for CFG, as
pocket/train.py) on its training digits at `DIM` of their brightness, from fixed seeds, and writes them as diffusers
writes a LoRA (`WanPipeline.save_lora_weights`: peft keys, its LoraConfig in the metadata), the layout
`teacher.lora=[FILE]` and `load_lora_weights` read. The shipped file is `assets/pocket/style_dim_lora.safetensors`.

Why dimming: the pocket VAE, trained on black canvases only, cannot draw what lies outside them -- a white frame
or a grey background comes back through it at a seventh of its brightness, black -- but it keeps a dim digit dim
(half the brightness in, 0.62 of it out). The style statistic (`digit_brightness`) is the mean of each image's
`PEAK` brightest pixels (their largest channel); the judge reads every image scaled to its peak (`normalised`), so
prompt accuracy and the style are measured apart.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from wandistiller.core.errors import OneLineParser, description
from wandistiller.pocket import POCKET_DIR, TEACHER_DIR
from wandistiller.pocket.build import normalised_latents, text_states
from wandistiller.pocket.digits import PROMPTS, rendered_split
from wandistiller.pocket.train import cosine_lr, flow_batch
from wandistiller.teacher.lora import Adapters

log = logging.getLogger("wandistiller.pocket")
STYLE_LORA_FILE = POCKET_DIR / "style_dim_lora.safetensors"
DIM = 0.5  # the style: every digit at half its brightness
PEAK = 32  # pixels a digit's brightness is read from (a 28x28 digit draws a few hundred)
RANK = 4
STEPS, QUICK_STEPS, LR = 300, 2, 3e-3


def dimmed(images: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] images in [0, 1] at the style's brightness (its training images)."""
    return images * DIM


def digit_brightness(images: torch.Tensor) -> torch.Tensor:
    """[N]: the mean of each image's PEAK brightest pixels (each pixel's largest channel), in [0, 1]."""
    peak = images.clamp(0, 1).amax(1).flatten(1)
    return peak.topk(min(PEAK, peak.shape[1]), dim=1).values.mean(1)


def normalised(images: torch.Tensor) -> torch.Tensor:
    """The images scaled so their brightest pixels are at 1: what the judge, trained on full-brightness digits,
    reads the digit and its colour from, whatever the brightness."""
    return (images.clamp(0, 1) / digit_brightness(images).clamp(min=0.05).view(-1, 1, 1, 1)).clamp(0, 1)


def train_style_lora(teacher_dir: Path = TEACHER_DIR, steps: int = STEPS, seed: int = 0) -> Adapters:
    """Rank-RANK adapters on every block's attention and FFN of the teacher at `teacher_dir`, fitted from `seed` to
    dimmed training digits with the teacher's own objective (rectified flow at its shift, 10% of prompts dropped for
    CFG, cosine lr); returned as their EMA, as pocket/train.py returns a transformer."""
    from diffusers import WanPipeline

    torch.manual_seed(seed)
    pipe = WanPipeline.from_pretrained(teacher_dir)
    images, _, prompts = rendered_split("train", copies=2, seed=seed + 1)
    latents = normalised_latents(pipe.vae, dimmed(images))
    table = text_states(pipe, PROMPTS)
    cond, uncond = table[torch.tensor([PROMPTS.index(p) for p in prompts])], text_states(pipe, [""])
    transformer = pipe.transformer.eval().requires_grad_(False)
    adapters = Adapters(transformer, RANK, seed=seed)
    ema = copy.deepcopy(adapters.state_dict())
    opt = torch.optim.AdamW(adapters.parameters(), LR, weight_decay=0.0)
    g, batch = torch.Generator().manual_seed(seed + 2), 64
    with adapters.active():
        for step in range(steps):
            noisy, t, text, velocity = flow_batch(latents, cond, uncond, batch, g)
            loss = F.mse_loss(transformer(noisy, t, text, return_dict=False)[0], velocity)
            cosine_lr(opt, step, steps, LR)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            decay = min(0.99, (1 + step) / (10 + step))
            with torch.no_grad():
                for k, v in adapters.state_dict().items():
                    ema[k].lerp_(v, 1 - decay)
            if (step + 1) % 50 == 0:
                log.info("style step %d/%d loss %.4f", step + 1, steps, float(loss))
    adapters.load_state_dict(ema)
    return adapters


def save_style_lora(adapters: Adapters, out: Path) -> Path:
    """The adapters at `out` as `WanPipeline.save_lora_weights` writes them (peft keys under `transformer.`, its
    LoraConfig in the metadata)."""
    from diffusers import WanPipeline

    out.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in adapters.peft_state_dict().items()}
    WanPipeline.save_lora_weights(
        out.parent,
        transformer_lora_layers=state,
        weight_name=out.name,
        transformer_lora_adapter_metadata=adapters.peft_metadata(),
    )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="python -m wandistiller.pocket.style", description=description(__doc__))
    parser.add_argument("--out", type=Path, default=STYLE_LORA_FILE, help="the LoRA file (default: the shipped one)")
    parser.add_argument("--quick", action="store_true", help="a few steps (a smoke test)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    clock = time.perf_counter()
    out = save_style_lora(train_style_lora(steps=QUICK_STEPS if args.quick else STEPS), args.out)
    print(f"{out} ({out.stat().st_size / 1024:.0f} KB) in {time.perf_counter() - clock:.0f} s")


if __name__ == "__main__":
    main()
