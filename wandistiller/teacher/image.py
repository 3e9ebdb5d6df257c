"""What an image-to-video teacher takes from its image, computed as the model's own diffusers pipeline computes it.

`WanImageToVideoPipeline.prepare_latents` and `encode_image` are the reference; every step here is theirs, in
their order and their arithmetic, so a teacher fed this conditioning computes the pipeline's velocity bit for bit
(tests/teacher/test_image.py):

- Wan 2.1 I2V and Wan 2.2 I2V A14B (`Layout.i2v`): the image, then black frames, through the VAE; a 4-channel mask
  that marks the first latent frame as given; both concatenated to the noise on the channels. Wan 2.1's experts
  also attend to CLIP's penultimate hidden states of the image.
- Wan 2.2 TI2V 5B (`Layout.ti2v`): the image alone through its VAE; that latent replaces the first latent frame,
  whose tokens get timestep 0 (`expand_timesteps`). Without an image it is a text-to-video model, as WanPipeline
  runs it: every token at the step's timestep.

`expert_inputs` is the other half: the transformer's inputs at one step, from the noisy latents and this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from wandistiller.core.arch import Layout
from wandistiller.teacher.spec import TeacherSpec, loading
from wandistiller.teacher.vae import pixel_frames

# Wan 2.1 I2V's experts get the image tokens and the text as one sequence, and diffusers' WanAttnProcessor splits
# it by taking the last 512 as the text ("hardcoded for now"): shorter text would be read as image tokens, in silence.
TEXT_TOKENS = 512


@dataclass(frozen=True)
class ImageCondition:
    """One image per sample, as its expert takes it (float32, batch first)."""

    # i2v: [B, 4 + z, F, h, w], the first-frame mask then the latents of the image followed by black frames;
    # ti2v: [B, z, 1, h, w], the image's own latent (the first latent frame's replacement).
    latents: torch.Tensor
    # Wan 2.1 I2V: CLIP's penultimate hidden states [B, tokens, image_dim]; None where the experts take none.
    embeds: torch.Tensor | None = None

    def select(self, rows: slice | torch.Tensor) -> ImageCondition:
        """The samples at `rows` (the ones an expert serves)."""
        return ImageCondition(self.latents[rows], None if self.embeds is None else self.embeds[rows])

    def to(self, device: torch.device, non_blocking: bool = False) -> ImageCondition:
        embeds = None if self.embeds is None else self.embeds.to(device, non_blocking=non_blocking)
        return ImageCondition(self.latents.to(device, non_blocking=non_blocking), embeds)

    @staticmethod
    def cat(parts: list[ImageCondition | None]) -> ImageCondition | None:
        """Several batches' conditioning as one (None where they have none)."""
        if all(p is None for p in parts):
            return None
        given = [p for p in parts if p is not None]
        if len(given) != len(parts):
            raise ValueError("some batches have an image and some not")
        embeds = None if given[0].embeds is None else torch.cat([p.embeds for p in given])  # type: ignore[misc]
        return ImageCondition(torch.cat([p.latents for p in given]), embeds)


def load_image_encoder(spec: TeacherSpec, device: torch.device, dtype: torch.dtype = torch.float32) -> tuple:
    """The teacher's CLIP vision tower and its image processor (Wan 2.1 I2V), frozen; (None, None) for a teacher
    without one."""
    if not spec.image_encoder:
        return None, None
    import transformers

    with loading(spec, "image encoder"):
        index = json.loads((spec.path / "model_index.json").read_text())  # checked by inspect_teacher
        encoder_cls = getattr(transformers, index["image_encoder"][-1])
        processor_cls = getattr(transformers, index["image_processor"][-1])
        encoder = encoder_cls.from_pretrained(spec.path, subfolder="image_encoder", dtype=dtype, use_safetensors=True)
        processor = processor_cls.from_pretrained(spec.path, subfolder="image_processor")
    return encoder.to(device).eval().requires_grad_(False), processor


def first_frame_mask(latents: torch.Tensor) -> torch.Tensor:
    """TI2V's mask over a latent video [B, C, F, h, w]: 0 on the first frame (given), 1 on the rest (denoised);
    [1, 1, F, h, w] float32, as `prepare_latents` makes it."""
    _, _, f, h, w = latents.shape
    mask = torch.ones(1, 1, f, h, w, dtype=torch.float32, device=latents.device)
    mask[:, :, 0] = 0
    return mask


def expert_inputs(
    layout: Layout, patch_size, x_t: torch.Tensor, t: torch.Tensor, image: ImageCondition | None, dtype: torch.dtype
) -> dict:
    """The transformer's keyword inputs besides the text for noisy latents `x_t` (float32) at per-sample
    timesteps `t`, as the pipeline's denoising loop builds them: combined in float32, then cast to `dtype`.
    `layout` and `patch_size` are the teacher's (a student's are the same: it takes what the teacher takes)."""
    if layout == Layout.t2v:
        return dict(hidden_states=x_t.to(dtype), timestep=t)
    _, ph, pw = patch_size
    if layout == Layout.ti2v and image is None:
        # TI2V 5B without an image is a text-to-video model: WanPipeline's loop, every token at the step's t.
        tokens = x_t[0, 0, :, ::ph, ::pw].numel()
        return dict(hidden_states=x_t.to(dtype), timestep=t.to(torch.float32)[:, None].expand(-1, tokens))
    if image is None:
        raise ValueError(f"an {layout} transformer's inputs need the image's conditioning (ImageCondition)")
    latents = image.latents.to(x_t.device, torch.float32)
    embeds = None if image.embeds is None else image.embeds.to(x_t.device, dtype)
    if layout == Layout.i2v:
        hidden = torch.cat([x_t.float(), latents], dim=1)
        return dict(hidden_states=hidden.to(dtype), timestep=t, encoder_hidden_states_image=embeds)
    mask = first_frame_mask(x_t)
    hidden = (1 - mask) * latents + mask * x_t.float()
    # One timestep per token, 0 on the given frame's: (mask over the patch grid) x t, row by row.
    per_token = mask[0, 0][:, ::ph, ::pw].flatten()
    timestep = per_token[None] * t.to(torch.float32)[:, None]
    return dict(hidden_states=hidden.to(dtype), timestep=timestep, encoder_hidden_states_image=embeds)


def denoised_frames(image: ImageCondition | None, x: torch.Tensor) -> torch.Tensor:
    """`x` [B, C, F, h, w] (a prediction, its target, x0, the noise) over the frames the model denoises: TI2V's
    given first frame, replaced by the image's latent and at timestep 0, is no prediction of its own, so its loss
    does not count (Wan 2.2's TI2V training masks it so); an I2V model predicts every frame. TI2V's conditioning
    is the one whose latents have the noise's channels (I2V's have 4 mask channels more)."""
    if image is None or image.latents.shape[1] != x.shape[1]:
        return x
    return x[:, :, image.latents.shape[2] :]


def doubled(inputs: dict) -> dict:
    """The same inputs twice along the batch: the cond and uncond halves of one CFG forward share the image."""
    return {k: None if v is None else torch.cat([v, v]) for k, v in inputs.items()}


@torch.no_grad()
def condition_latents(layout: Layout, vae, images: list, latent_frames: int, height: int, width: int) -> torch.Tensor:
    """`ImageCondition.latents` of `images`: resized by diffusers' VideoProcessor, encoded to the posterior's mode,
    normalised as `(z - mean) * (1 / std)` (the pipeline's own arithmetic, not `/ std`: they differ in the last
    bit); for Layout.i2v the image then black frames, behind the first-frame mask. A data source caches these
    apart from `clip_embeds`, so each half loads only its own model; the pocket I2V build (no teacher folder
    yet) conditions its training clips with it too."""
    from diffusers.video_processor import VideoProcessor

    if layout == Layout.t2v:
        raise ValueError("a text-to-video teacher takes no image")
    device = vae.device
    pixels = VideoProcessor(vae_scale_factor=vae.config.scale_factor_spatial).preprocess(
        images, height=height, width=width
    )
    pixels = pixels.to(device, torch.float32)[:, :, None]  # [B, 3, 1, H, W]
    if layout == Layout.i2v:
        frames = pixel_frames(latent_frames, vae.config)
        black = pixels.new_zeros(pixels.shape[0], pixels.shape[1], frames - 1, height, width)
        pixels = torch.cat([pixels, black], dim=2)
    z = vae.encode(pixels.to(vae.dtype)).latent_dist.mode().to(torch.float32)
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(device, torch.float32)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(device, torch.float32)
    z = (z - mean) * inv_std
    if layout == Layout.ti2v:
        return z
    b, _, f, h, w = z.shape
    mask = torch.zeros(b, int(vae.config.scale_factor_temporal), f, h, w, device=device)
    mask[:, :, 0] = 1  # every pixel frame the first latent frame holds is given (the pipeline's repeat of frame 0)
    return torch.cat([mask, z], dim=1)


@torch.no_grad()
def clip_embeds(image_encoder, image_processor, images: list) -> torch.Tensor:
    """Wan 2.1 I2V's image tokens of `images`: CLIP's penultimate hidden states [B, tokens, image_dim], float32,
    as the pipeline's `encode_image`."""
    clip_inputs = image_processor(images=images, return_tensors="pt").to(image_encoder.device)
    return image_encoder(**clip_inputs, output_hidden_states=True).hidden_states[-2].to(torch.float32)
