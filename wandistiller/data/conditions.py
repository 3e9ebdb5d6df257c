"""The image an image-to-video teacher is conditioned on, one per caption: a captioned folder's images
(`data=image_folder`) or its clips' first frames (`data=video_folder`), encoded once with the teacher's own VAE
(and, for Wan 2.1 I2V, its CLIP) through teacher/image.py, so a batch's conditioning is the pipeline's, and cached.

An image is scaled to cover the run's frame size (latent size x the VAE's spatial factor) and center-cropped, as a
clip's frames are (wandistiller.data.videos), never scaled up: the given image is the clip's first frame, and an
upscaled one would be a blurred first frame the student learns to keep. WanImageToVideoPipeline then resizes it to
that same size (a no-op), so what a user passes to the pipeline at that size is what the student trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from wandistiller.core.errors import UserError
from wandistiller.core.tensor_files import file_stamps
from wandistiller.data.latents import LatentBank, cached_bank
from wandistiller.teacher.image import ImageCondition, clip_embeds, condition_latents, load_image_encoder
from wandistiller.teacher.spec import TeacherSpec, read_json
from wandistiller.teacher.vae import load_vae


@dataclass(frozen=True)
class ImageBank:
    """Each prompt's image conditioning, memory-mapped from the cache: prompt i's is item `rows[i]`."""

    latents: LatentBank  # ImageCondition.latents, one item per image
    embeds: LatentBank | None  # ImageCondition.embeds (Wan 2.1 I2V's CLIP tokens); None where the experts take none
    rows: torch.Tensor  # [P] long
    # Its cache folder's name (teacher, images, clip size): what a cache made from these images is keyed on.
    key: str = ""

    def __len__(self) -> int:
        return len(self.rows)

    def identity(self) -> str:
        """What tells these prompts' images from any others: the cache's key and the rows (a bank built in memory,
        keyless, by its contents)."""
        rows = hashlib.sha256(self.rows.numpy().tobytes()).hexdigest()[:12]
        if self.key:
            return f"{self.key}:{rows}"
        contents = [self.latents.x0(self.rows), *([] if self.embeds is None else [self.embeds.x0(self.rows)])]
        return "contents:" + hashlib.sha256(b"".join(t.numpy().tobytes() for t in contents)).hexdigest()[:20]

    def select(self, prompt_idx: torch.Tensor) -> ImageCondition:
        """The conditioning of these prompts, float32 on the CPU (a batch moves it with the rest)."""
        items = self.rows[prompt_idx.cpu()]
        return ImageCondition(self.latents.x0(items), None if self.embeds is None else self.embeds.x0(items))

    def part(self, rows: slice) -> ImageBank:
        """The bank over prompts `rows` only (training's, or the held-out captions')."""
        return ImageBank(self.latents, self.embeds, self.rows[rows], self.key)


def fitted(image: Image.Image, height: int, width: int, name: str, key: str) -> Image.Image:
    """`image` upright (EXIF), in RGB, scaled down to cover height x width and center-cropped (as a clip's frames),
    once `check_given` has let it through."""
    image = check_given(ImageOps.exif_transpose(image), height, width, name, key)
    return ImageOps.fit(rgb(image), (width, height), method=Image.Resampling.BICUBIC)


def unreadable(error: Exception) -> str:
    """Why PIL could not read an image, where the reason is the user's to act on: PIL's decompression-bomb guard
    refuses a large valid image (20000x20000) in words that read as a damaged file's; else the damaged file's."""
    if isinstance(error, Image.DecompressionBombError):
        return (
            f"is too large for PIL to decode ({str(error).split(',')[0]}, a guard against decompression bombs); "
            "scale it down"
        )
    return "is not a readable image"


def check_given(image: Image.Image, height: int, width: int, name: str, key: str) -> Image.Image:
    """`image` (upright) as it is, refused in one line where it cannot be a clip's first frame: smaller than
    height x width (scaling up would give the student a blurred first frame to keep), or with transparent pixels
    (converting to RGB would paint them black, a first frame nobody meant)."""
    if image.mode == "F":  # floating-point pixels (a TIFF's): no range PIL can know; 0..1 became a black frame
        raise UserError(
            f"{key}: {name} holds floating-point pixels (mode F), whose range is unknown; save it as an 8- or 16-bit "
            "PNG"
        )
    if image.width < width or image.height < height:
        raise UserError(
            f"{key}: {name} is {image.width}x{image.height}, too small for the run's {width}x{height} frames (width x "
            "height; an image-to-video teacher's given image is its first frame, scaled down and cropped, never up); "
            + (
                "give a larger image"
                if key.startswith("--")
                else "give larger images or lower data.latent_height/latent_width"
            )
        )
    return opaque(image, name, key)


def opaque(image: Image.Image, name: str, key: str) -> Image.Image:
    """`image` as it is, refused in one line where it has transparent pixels, which a first frame cannot show
    (converting it to RGB would show whatever lies under them: often black; in a WebP, whatever its encoder left).
    A given still and a clip's first frame (data/videos.py) alike."""
    if _may_be_transparent(image):
        if np.asarray(image.convert("RGBA").getchannel("A")).min() < 255:
            raise UserError(
                f"{key}: {name} has transparent pixels (mode {image.mode}), which a first frame cannot show; "
                "flatten it onto a background (save it as RGB)"
            )
    return image


def frame_size(data_cfg, vae_config: dict) -> tuple[int, int]:
    """(height, width) in pixels of the run's frames: its latent size x the VAE's spatial factor."""
    scale = int(vae_config.get("scale_factor_spatial", 8))
    return data_cfg.latent_height * scale, data_cfg.latent_width * scale


# How `rgb` makes pixels, in the x0 latent caches' keys: a cache made before transparent pixels went on black is
# made again (the same latents for opaque images: the VAE's mode is a function of the pixels alone).
PIXELS = "rgb, alpha on black"


def rgb(image: Image.Image) -> Image.Image:
    """`image` in RGB; 16-bit greyscale scaled to 8 bits first (PIL's convert("RGB") clips it to white), transparent
    pixels composited onto black (convert("RGB") would show the colour stored under them, which differs by encoder: a
    PNG keeps it, an animated WebP's drops it). A still's and a clip's frames alike (x0; a given image is refused
    transparent, `opaque`)."""
    if image.mode.startswith("I"):
        image = Image.fromarray((np.asarray(image, dtype=np.float32) / 257.0).round().clip(0, 255).astype(np.uint8))
    if _may_be_transparent(image):
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (0, 0, 0, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _may_be_transparent(image: Image.Image) -> bool:
    """Whether `image`'s mode or header allows see-through pixels (an alpha channel, or a transparent colour)."""
    return image.mode in ("RGBA", "RGBa", "LA", "La", "PA") or "transparency" in image.info


def image_bank(
    spec: TeacherSpec,
    opened: Callable[[int], Image.Image],
    names: Callable[[int], str],
    count: int,
    fingerprint: str,
    data_cfg,
    cache_dir: str | os.PathLike,
    device: torch.device,
    key: str,
    progress: bool = True,
) -> ImageBank:
    """The conditioning of images 0..count-1 (`opened(i)` opens one, `names(i)` names it in an error) for clips of
    `data.latent_frames` at the run's latent size, made once per chunk and cached under
    `cache_dir/image_conditions/<key>/`; image i is prompt i's."""
    d = data_cfg
    vae_config = read_json(spec.path / "vae" / "config.json", "teacher.path")
    height, width = frame_size(d, vae_config)
    models_used = ("vae", "image_encoder") if spec.image_encoder else ("vae",)
    weights = [file_stamps(spec.path / sub, "*.safetensors") for sub in models_used]
    teacher_id = [str(spec.path.resolve()), spec.layout.value, vae_config, weights]
    blob = json.dumps([teacher_id, fingerprint, d.latent_frames, d.latent_height, d.latent_width], sort_keys=True)
    folder = Path(cache_dir).expanduser() / "image_conditions" / hashlib.sha256(blob.encode()).hexdigest()[:20]
    pictures = lambda items: [fitted(opened(i), height, width, names(i), key) for i in items]
    models: dict = {}  # each loaded only when a chunk of its own is missing

    def make_latents(items: range) -> torch.Tensor:
        if "vae" not in models:
            models["vae"] = load_vae(spec, device)
        return condition_latents(spec.layout, models["vae"], pictures(items), d.latent_frames, height, width).cpu()

    def make_embeds(items: range) -> torch.Tensor:
        if "clip" not in models:
            models["clip"] = load_image_encoder(spec, device)
        encoder, processor = models["clip"]
        return clip_embeds(encoder, processor, pictures(items)).cpu()

    chunk = d.latent_chunk
    latents = cached_bank(folder / "latents", count, chunk, 1, make_latents, "image conditioning", progress)
    embeds = (
        cached_bank(folder / "embeds", count, chunk, 1, make_embeds, "image tokens", progress)
        if spec.image_encoder
        else None
    )
    return ImageBank(latents, embeds, torch.arange(count), folder.name)
