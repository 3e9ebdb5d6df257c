"""The one WanPipeline wrapper: diffusers' own sampling loop around transformers already loaded (a teacher's
experts, or a student in the teacher's place), with the teacher's own scheduler, so the sample grids, the
teacher latents, `eval` and `generate` all sample the same way. No text encoder (embeddings are cached); a
VAE only where images are wanted (else latents come out)."""

from __future__ import annotations

import json

import torch

from wandistiller.core.arch import Layout
from wandistiller.teacher.image import first_frame_mask
from wandistiller.teacher.spec import TeacherSpec, loading


def load_scheduler(spec: TeacherSpec):
    """The teacher's own scheduler class and config (UniPC for diffusers' Wan, FlowMatchEuler for others)."""
    import diffusers

    index = json.loads((spec.path / "model_index.json").read_text())  # checked by inspect_teacher
    with loading(spec, "scheduler"):
        return getattr(diffusers, index["scheduler"][-1]).from_pretrained(spec.path, subfolder="scheduler")


def calls_per_image(steps: int, guidance_scale: float) -> int:
    """Transformer forwards WanPipeline makes for one image: one per step, two (cond, uncond) where it applies
    CFG, which it does where the (first) guidance scale is above 1."""
    return steps * (2 if guidance_scale > 1.0 else 1)


def wan_pipeline(spec: TeacherSpec, transformers: list, device: torch.device, vae=None, scheduler=None):
    """WanPipeline over `transformers` (two: the experts, split at the teacher's boundary), computing on
    `device`, with the teacher's own scheduler or `scheduler` (a few-step student's, teacher/fewstep.py).
    WanPipeline infers its device from its modules' parameters, and a streamed or spread teacher's
    parameters are not where it computes: the pipeline is pinned to `device`."""
    from diffusers import WanPipeline

    return _pinned(WanPipeline, spec, transformers, device, vae, scheduler)


def image_pipeline(
    spec: TeacherSpec, transformers: list, device: torch.device, vae, scheduler=None, image_encoder=(None, None)
):
    """WanImageToVideoPipeline over `transformers`, pinned and scheduled as `wan_pipeline`: the model's own
    image-to-video loop. Given an image, it encodes it itself (the VAE, and Wan 2.1 I2V's CLIP: `image_encoder`, the
    pair `load_image_encoder` returns); given a cached `ImageCondition` instead (`sample_latents(condition=)`: a
    training run's probe images, already encoded exactly as the pipeline encodes them, teacher/image.py), its
    `prepare_latents` returns that conditioning beside the noise, and the loop runs on it unchanged."""
    from diffusers import WanImageToVideoPipeline
    from diffusers.utils.torch_utils import randn_tensor

    class ImageToVideo(WanImageToVideoPipeline):
        condition = None  # an ImageCondition for the next call, or None: the pipeline's own encoding of its image

        def prepare_latents(self, image, batch_size, *args):  # the pipeline passes every argument by position
            if self.condition is None:
                return super().prepare_latents(image, batch_size, *args)
            channels, height, width, frames, dtype, device, generator, latents, _last = args
            given = self.condition.latents.to(device, dtype).expand(batch_size, -1, -1, -1, -1)
            if latents is None:  # the pipeline's own draw
                side, folded = self.vae_scale_factor_spatial, self.vae_scale_factor_temporal
                shape = (batch_size, channels, (frames - 1) // folded + 1, height // side, width // side)
                latents = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
            latents = latents.to(device, dtype)
            if self.config.expand_timesteps:
                return latents, given, first_frame_mask(latents)
            return latents, given

        def encode_image(self, image, device):  # Wan 2.1 I2V's CLIP tokens, cached with the rest
            if self.condition is None:
                return super().encode_image(image, device)
            return self.condition.embeds.to(device)

    encoder, processor = image_encoder
    return _pinned(
        ImageToVideo,
        spec,
        transformers,
        device,
        vae,
        scheduler,
        image_encoder=encoder,
        image_processor=processor,
        expand_timesteps=spec.layout == Layout.ti2v,
    )


def given_image(pipe, height: int, width: int, image=None, condition=None) -> dict:
    """The image arguments of one `image_pipeline` call at height x width pixels: `image` (a PIL image, which the
    pipeline encodes), or `condition` (an ImageCondition, encoded already; the pipeline's image argument is then a
    black frame of that size, which it validates and resizes but never reads); {} for neither (text to video)."""
    if image is None and condition is None:
        return {}
    pipe.condition = condition
    return {"image": torch.zeros(1, 3, height, width) if image is None else image}


def _pinned(base, spec: TeacherSpec, transformers: list, device: torch.device, vae, scheduler, **parts):
    class PinnedPipeline(base):
        @property
        def _execution_device(self):
            return device

    two = len(transformers) == 2
    pipe = PinnedPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        scheduler=load_scheduler(spec) if scheduler is None else scheduler,
        transformer=transformers[0],
        transformer_2=transformers[1] if two else None,
        boundary_ratio=spec.boundary_ratio if two else None,
        **parts,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
