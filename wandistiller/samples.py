"""A PNG grid of teacher vs student samples, drawn with diffusers' own WanPipeline.

The student is a WanTransformer3DModel, so it drops into WanPipeline as `transformer`; it was trained
on guided targets, so it samples without CFG (guidance_scale=1).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from wandistiller.data import PromptEmbeddings
from wandistiller.teacher import Teacher

CELL = 192  # pixels per sample in the grid, so tiny teachers' 64-pixel samples stay visible


@torch.no_grad()
def sample_grid(
    teacher: Teacher,
    student_transformer: torch.nn.Module,
    embeddings: PromptEmbeddings,
    data_cfg,
    num_prompts: int,
    steps: int,
    seed: int,
    path: Path,
) -> Path:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    spec = teacher.spec
    vae = AutoencoderKLWan.from_pretrained(spec.path, subfolder="vae", torch_dtype=torch.float32, use_safetensors=True)
    scheduler = UniPCMultistepScheduler.from_pretrained(spec.path, subfolder="scheduler")
    idx = torch.arange(min(num_prompts, len(embeddings.prompts)))
    cond, uncond = embeddings.padded(idx), embeddings.negative_batch(len(idx)).contiguous()
    size = dict(
        height=data_cfg.latent_height * vae.config.scale_factor_spatial,
        width=data_cfg.latent_width * vae.config.scale_factor_spatial,
        num_frames=(data_cfg.latent_frames - 1) * vae.config.scale_factor_temporal + 1,
    )

    def draw(transformer, transformer_2, guidance, guidance_2, boundary):
        device = next(transformer.parameters()).device
        pipe = WanPipeline(
            tokenizer=None,
            text_encoder=None,
            vae=vae.to(device),
            scheduler=scheduler,
            transformer=transformer,
            transformer_2=transformer_2,
            boundary_ratio=boundary,
        )
        pipe.set_progress_bar_config(disable=True)
        dtype = transformer.dtype
        frames = pipe(
            prompt_embeds=cond.to(device, dtype),
            negative_prompt_embeds=uncond.to(device, dtype),
            guidance_scale=guidance,
            guidance_scale_2=guidance_2,
            num_inference_steps=steps,
            output_type="np",
            generator=torch.Generator(device).manual_seed(seed),
            **size,
        ).frames
        return frames[:, 0]  # first frame of each video

    experts = teacher.experts + [None] * (2 - len(teacher.experts))
    scales = teacher.guidance_scales + [None] * (2 - len(teacher.guidance_scales))
    teacher_imgs = draw(experts[0], experts[1], scales[0], scales[1], spec.boundary_ratio)
    student_imgs = draw(student_transformer, None, 1.0, None, None)
    return _save_grid(teacher_imgs, student_imgs, [embeddings.prompts[i] for i in idx], path)


def _save_grid(teacher_imgs: np.ndarray, student_imgs: np.ndarray, prompts: list[str], path: Path) -> Path:
    header, caption = 24, 36
    grid = Image.new("RGB", (2 * CELL, header + len(prompts) * (CELL + caption)), "white")
    pen = ImageDraw.Draw(grid)
    pen.text((8, 6), "teacher", fill="black")
    pen.text((CELL + 8, 6), "student", fill="black")
    for row, (a, b, prompt) in enumerate(zip(teacher_imgs, student_imgs, prompts)):
        top = header + row * (CELL + caption)
        for col, img in enumerate((a, b)):
            pixels = Image.fromarray((np.clip(img, 0, 1) * 255).round().astype(np.uint8))
            grid.paste(pixels.resize((CELL, CELL), Image.NEAREST), (col * CELL, top))
        pen.text((6, top + CELL + 3), "\n".join(textwrap.wrap(prompt, 60)[:2]), fill="black")
    grid.save(path)
    return path
