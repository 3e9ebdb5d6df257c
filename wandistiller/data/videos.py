"""Real clips as x0: a captioned folder of video files, each decoded, resized and center-cropped to the teacher's
frame size, cut to the clip length `data.latent_frames` makes, and encoded once with the teacher's own VAE into a
cached LatentBank; captions through the teacher's text encoder (wandistiller.data.images does the same for stills).

A folder holds videos with a caption each: `name.txt` beside `name.mp4`, or one `captions.jsonl` of
{"file_name": ..., "text": ...} lines, as an image folder does. Animated GIF and WebP decode through PIL; MP4,
MOV, MKV, WebM and AVI through PyAV (`pip install av`), an optional package.

A clip is the video's first (latent_frames - 1) x scale_factor_temporal + 1 frames (Wan's causal VAE keeps the
first frame alone: 81 frames make 21 latent frames), taking every `data.frame_step`-th frame. Frames are scaled
down to cover the frame size (latent size x the VAE's spatial factor) and center-cropped; never scaled up, so a
video smaller than the frame size is refused, as is one with too few frames, one that does not decode, and an
empty folder: each in one line before the run folder is claimed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, ImageSequence

from wandistiller.core.errors import UserError
from wandistiller.core.tensor_files import file_stamps
from wandistiller.data.conditions import PIXELS, fitted, frame_size, image_bank, opaque, rgb
from wandistiller.data.images import (
    IMAGE_SUFFIXES,
    PIL_SUFFIXES,
    VIDEO_SUFFIXES,
    captioned_files,
    captions_of,
    first_only,
)
from wandistiller.data.latents import LatentBank, cached_bank
from wandistiller.data.prompts import PromptEmbeddings, encode_prompts
from wandistiller.teacher.spec import TeacherSpec, read_json
from wandistiller.teacher.vae import encode_clips, load_vae, pixel_frames


@dataclass
class VideoSource:
    """Captions, the video files (for errors and decoding), what the user called it and a fingerprint."""

    captions: list[str]
    files: list[Path]
    root: Path
    key: str
    fingerprint: str

    def name(self, i: int) -> str:
        return self.files[i].relative_to(self.root).as_posix()


@dataclass(frozen=True)
class ClipShape:
    """What a clip must be: its frames (of the file, every `step`-th) and the frame size, in pixels."""

    frames: int
    step: int
    height: int
    width: int

    @classmethod
    def of(cls, data_cfg, vae_config: dict) -> ClipShape:
        scale = int(vae_config.get("scale_factor_spatial", 8))
        return cls(
            pixel_frames(data_cfg.latent_frames, vae_config),
            int(data_cfg.frame_step),
            data_cfg.latent_height * scale,
            data_cfg.latent_width * scale,
        )

    def what(self, data_cfg) -> str:
        return (
            f"{self.frames} frames of {self.width}x{self.height} (data.latent_frames={data_cfg.latent_frames}, "
            f"latent {data_cfg.latent_width}x{data_cfg.latent_height}"
            + (f", every {self.step}th frame" if self.step > 1 else "")
            + ")"
        )


def folder_videos(root: str) -> VideoSource:
    """The videos and captions of `data.root`, refused in one line where they cannot serve (no folder, no videos,
    an uncaptioned one); the frames are checked by `check_clips`."""
    path, key, files, every = captioned_files(
        root, VIDEO_SUFFIXES, "videos", (IMAGE_SUFFIXES, "images", "data=image_folder")
    )
    # A still among the clips would be dropped unread: named, as image_folder names a clip among its stills.
    still = first_only(every, IMAGE_SUFFIXES, VIDEO_SUFFIXES)
    if still is not None:
        raise UserError(
            f"{key}: {still.relative_to(path).as_posix()} is a still image, and data=video_folder takes clips (an "
            "image-to-video teacher's given image is each clip's first frame); for stills use data=image_folder, "
            "or move it out of the folder"
        )
    captions, fingerprint = captions_of(path, key, files, "video", every)
    return VideoSource(captions, files, path, key, fingerprint)


def _pil_frames(path: Path, count: int) -> tuple[list[Image.Image], tuple[int, int]]:
    frames = []
    with Image.open(path) as video:
        if video.format not in ("GIF", "WEBP"):
            raise ValueError(f"a {video.format} image, not an animated GIF or WebP")
        for frame in ImageSequence.Iterator(video):
            # A copy, decoded in full here (truncated: raises), its alpha kept: a transparent first frame is refused
            # as a given image, as a transparent still is (conditions.opaque).
            frames.append(frame.copy())
            if len(frames) == count:
                break
        return frames, video.size


def _av_frames(path: Path, count: int, key: str) -> tuple[list[Image.Image], tuple[int, int]]:
    try:
        import av  # optional: MP4 and other containers
    except ImportError:
        raise UserError(
            f"{key}: {path.name} is a {path.suffix} video, which needs PyAV to decode; pip install av "
            f"(or give animated GIF or WebP files)"
        ) from None
    frames: list[Image.Image] = []
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        for frame in container.decode(video=0):
            frames.append(_av_image(frame))
            if len(frames) == count:
                break
    size = frames[0].size if frames else (0, 0)
    return frames, size


def _av_image(frame) -> Image.Image:
    """A decoded frame as a player shows it: upright, by the display matrix a phone writes for a video held sideways
    (PyAV decodes the sensor's orientation: a portrait clip came out lying down, and was cropped so), and its alpha
    kept where it has one (a ProRes 4444 or PNG MOV), so that clear pixels go on black as a GIF's do
    (`conditions.rgb`) and a clear first frame is refused as a given image (`conditions.opaque`); to_image() dropped
    it, leaving whatever colour the encoder stored under them."""
    alpha = any(component.is_alpha for component in frame.format.components)
    image = Image.fromarray(frame.to_ndarray(format="rgba"), "RGBA") if alpha else frame.to_image()
    return image.rotate(frame.rotation, expand=True) if frame.rotation else image  # a quarter turn: exact


def read_clip(source: VideoSource, i: int, shape: ClipShape, data_cfg, decoded: bool = False) -> list[Image.Image]:
    """Video i's first `shape.frames` frames (every `shape.step`-th) in RGB, transparent pixels on black as a still's
    (`conditions.rgb`; `decoded`: as decoded, alpha kept), refused in one line where it does not decode, is too
    short, or is smaller than the frame size."""
    path, name = source.files[i], source.name(i)
    needed = (shape.frames - 1) * shape.step + 1
    try:
        if path.suffix.lower() in PIL_SUFFIXES:
            frames, size = _pil_frames(path, needed)
        else:
            frames, size = _av_frames(path, needed, source.key)
    except UserError:
        raise
    except Exception as e:  # PIL and PyAV raise many types for a damaged or foreign file; all mean the same here
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"{source.key}: {name} is not a readable video (truncated or not a video: {reason[:120]}); "
            "replace or remove it"
        ) from None
    if len(frames) == 1 and needed > 1:  # a still saved as a GIF or WebP: not a short clip
        raise UserError(
            f"{source.key}: {name} has one frame, a still, and data=video_folder takes clips; move it out of the "
            "folder (stills train with data=image_folder)"
        )
    if len(frames) < needed:
        raise UserError(
            f"{source.key}: {name} has {len(frames)} frame(s), fewer than the {needed} a clip of "
            f"{shape.what(data_cfg)} takes; lower data.latent_frames"
            + (" or data.frame_step" if shape.step > 1 else "")
            + " or remove it"
        )
    width, height = size
    if width < shape.width or height < shape.height:
        raise UserError(
            f"{source.key}: {name} is {width}x{height}, smaller than the {shape.width}x{shape.height} frames of "
            f"{shape.what(data_cfg)} (videos are scaled down and cropped, never up); give larger videos or "
            "lower data.latent_height/latent_width"
        )
    frames = frames[:: shape.step]
    return frames if decoded else [rgb(frame) for frame in frames]


def clip_pixels(frames: list[Image.Image], shape: ClipShape) -> torch.Tensor:
    """Frames scaled to cover the frame size, center-cropped, in [-1, 1]: [3, F, H, W]."""
    fitted = [ImageOps.fit(f, (shape.width, shape.height), method=Image.Resampling.BICUBIC) for f in frames]
    array = np.stack([np.asarray(f, dtype=np.float32) for f in fitted])  # [F, H, W, 3]
    return torch.from_numpy(array / 127.5 - 1.0).permute(3, 0, 1, 2)


def check_clips(data_cfg, vae_config: dict, given: bool = False) -> VideoSource:
    """Every video decodes into a whole clip of the run's shape, and (`given`: an image-to-video teacher's) its first
    frame can be a given image, opaque as a given still must be (the preflight calls this before anything heavy,
    once the teacher's VAE config is known)."""
    source = folder_videos(data_cfg.root)
    shape = ClipShape.of(data_cfg, vae_config)
    for i in range(len(source.files)):
        frames = read_clip(source, i, shape, data_cfg, decoded=given)
        if given:
            opaque(frames[0], source.name(i), source.key)
    return source


def video_latents(
    spec: TeacherSpec,
    source: VideoSource,
    data_cfg,
    cache_dir: str | os.PathLike,
    device: torch.device,
    progress: bool = True,
) -> LatentBank:
    """The clips as normalised VAE latents [C, latent_frames, h, w], cached and resumable by chunk."""
    channels = spec.latent_channels  # x0's, not an I2V expert's input (noise + mask + image)
    latent_shape = (channels, data_cfg.latent_frames, data_cfg.latent_height, data_cfg.latent_width)
    vae_config = read_json(spec.path / "vae" / "config.json", "teacher.path")
    shape = ClipShape.of(data_cfg, vae_config)
    vae_id = [str(spec.path.resolve()), vae_config, file_stamps(spec.path / "vae", "*.safetensors")]
    blob = json.dumps([vae_id, source.fingerprint, list(latent_shape), shape.step, PIXELS], sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()[:20]
    vae: list = []  # loaded only when a chunk is missing

    def make_chunk(items: range) -> torch.Tensor:
        if not vae:
            vae.append(load_vae(spec, device))
        pixels = torch.stack([clip_pixels(read_clip(source, i, shape, data_cfg), shape) for i in items])
        return encode_clips(vae[0], pixels)

    folder = Path(cache_dir).expanduser() / "video_latents" / key
    total, chunk = len(source.captions), data_cfg.latent_chunk
    return cached_bank(folder, total, chunk, 1, make_chunk, "video latents", progress, latent_shape)


def video_data(spec: TeacherSpec, data_cfg, teacher_cfg, dtype, device, cache_dir, progress=True):
    """(caption embeddings, LatentBank) for `data.latents=videos`: bank item i is video i, prompt i."""
    source = folder_videos(data_cfg.root)
    bank = video_latents(spec, source, data_cfg, cache_dir, device, progress)
    embeddings: PromptEmbeddings = encode_prompts(
        spec, source.captions, teacher_cfg.negative_prompt, teacher_cfg.max_sequence_length, dtype, device, cache_dir
    )
    return embeddings, bank


def video_pairs(spec: TeacherSpec, data_cfg, teacher_cfg, dtype, device, cache_dir, progress=True):
    """(caption embeddings, LatentBank, ImageBank) for an image-to-video teacher on `data.latents=videos`: clip i
    is x0 and its first frame the given image of prompt i, as Wan's own I2V training pairs them."""
    embeddings, bank = video_data(spec, data_cfg, teacher_cfg, dtype, device, cache_dir, progress)
    source = folder_videos(data_cfg.root)
    shape = ClipShape.of(data_cfg, read_json(spec.path / "vae" / "config.json", "teacher.path"))
    first = lambda i: _first_frame(source, i, shape, data_cfg)
    count = len(source.captions)
    images = image_bank(
        spec, first, source.name, count, source.fingerprint, data_cfg, cache_dir, device, source.key, progress
    )
    return embeddings, bank, images


def held_out_first_frames(data_cfg, vae_config: dict, held: int) -> list[Image.Image]:
    """The first frames of the last `held` clips (the held-out captions', in order), fitted as `video_pairs` fits
    them: what an image-to-video run's evaluation continues."""
    source = folder_videos(data_cfg.root)
    shape, (height, width) = ClipShape.of(data_cfg, vae_config), frame_size(data_cfg, vae_config)
    count = len(source.captions)
    return [
        fitted(_first_frame(source, i, shape, data_cfg), height, width, source.name(i), source.key)
        for i in range(count - held, count)
    ]


def _first_frame(source: VideoSource, i: int, shape: ClipShape, data_cfg) -> Image.Image:
    """Clip i's first frame as decoded, alpha kept (`image_bank` fits it as `clip_pixels` fits the clip, and refuses
    it transparent as it refuses a still); the clip is read whole, so a video refused for training is refused here the
    same way."""
    return read_clip(source, i, shape, data_cfg, decoded=True)[0]
