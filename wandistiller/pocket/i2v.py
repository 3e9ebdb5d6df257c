"""The pocket image-to-video teacher: `teacher=pocket_i2v` (one transformer) and `pocket_i2v_moe` (Wan 2.2 I2V A14B's
layout: two experts split at t = 900, no image encoder).

Built by `python -m wandistiller.pocket.build --only i2v` from the pocket video teacher, as Wan's own I2V models grew
from its text-to-video ones: the same tokenizer, text encoder and VAE; the transformer's patch embedding takes the
first-frame mask (2 channels: this VAE folds 2 frames into a latent frame) and the given image's latents beside the
noise, their weights started at zero (so it starts as the video teacher, blind to the image), then fine-tuned on
the clips with their first frame given, conditioned exactly as WanImageToVideoPipeline conditions a sample
(teacher/image.py `condition_latents`). The text is dropped for CFG, the image never: the pipeline's unconditional
pass keeps the image.

Its judge is the video teacher's frame judge; its data (`data=image_folder data.dataset=<the shipped i2v_pairs>`) one
first frame per video prompt, rendered from the training digits, with the prompt that says its motion.
"""

from __future__ import annotations

import torch

from wandistiller.core.arch import POCKET_TRANSFORMER, Layout
from wandistiller.pocket.clips import FRAMES, ClipAttributes, parse_video_prompt, render_clips
from wandistiller.pocket.digits import load_digits
from wandistiller.teacher.image import condition_latents

LATENT_FRAMES = (FRAMES - 1) // 2 + 1  # 9 frames through the 2x temporal VAE
MASK_CHANNELS = 2  # one per pixel frame the VAE folds into a latent frame (WanImageToVideoPipeline's mask)
Z = 16
POCKET_I2V_TRANSFORMER = POCKET_TRANSFORMER | dict(in_channels=Z + MASK_CHANNELS + Z, out_channels=Z)


def grown_state(video_state: dict) -> dict:
    """The video teacher's weights with the patch embedding's input grown by the mask and image channels, their
    weights zero: the grown model computes exactly what the video teacher does until training teaches it the image."""
    state = dict(video_state)
    weight = state["patch_embedding.weight"]  # [dim, Z, 1, 2, 2]
    extra = weight.new_zeros(weight.shape[0], MASK_CHANNELS + Z, *weight.shape[2:])
    state["patch_embedding.weight"] = torch.cat([weight, extra], dim=1)
    return state


@torch.no_grad()
def first_frame_conditions(vae, clips: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """[N, F, 3, H, W] clips in [0, 1] -> their first frames' conditioning [N, mask + Z, f, h, w], as
    WanImageToVideoPipeline computes a given image's (teacher/image.py `condition_latents`)."""
    _, _, _, height, width = clips.shape
    rows = [
        condition_latents(Layout.i2v, vae, list(clips[i : i + batch, 0]), LATENT_FRAMES, height, width)
        for i in range(0, len(clips), batch)
    ]
    return torch.cat(rows)


def clips_for(prompts: list[str], split: str, seed: int) -> torch.Tensor:
    """One rendered clip [len(prompts), F, 3, 32, 32] per pocket video prompt, its digit drawn (with `seed`) among
    `split`'s real digits of that class, its colour and motion the prompt's: a prompt's first frame and the clip
    the teacher was trained to continue it with."""
    digits, labels = load_digits(split)
    g = torch.Generator().manual_seed(seed)
    asked: list[ClipAttributes] = []
    for p in prompts:
        a = parse_video_prompt(p)
        if a is None:
            raise ValueError(f"not a pocket video prompt: {p!r}")
        asked.append(a)
    picks = []
    for a in asked:
        pool = (labels == a.digit).nonzero().flatten()
        picks.append(pool[torch.randint(len(pool), (1,), generator=g)])
    pick = torch.cat(picks)
    colour = torch.tensor([a.colour for a in asked])
    motion = torch.tensor([a.motion for a in asked])
    return render_clips(digits[pick], colour, motion, g)
