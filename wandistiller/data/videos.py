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

import dataclasses
import hashlib
import json
import logging
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, ImageSequence

from wandistiller.core.errors import UserError
from wandistiller.core.tensor_files import file_stamps
from wandistiller.data.conditions import PIXELS, fitted, frame_size, image_bank, opaque, rgb, unreadable
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

log = logging.getLogger(__name__)
_SAID_RATES: set[str] = set()  # folders whose mixed frame rates were said, once a process


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
    """What a clip must be: its frames (of the file, every `step`-th; or with `fps`, the frame shown at each
    1 / fps seconds) and the frame size, in pixels."""

    frames: int
    step: int
    height: int
    width: int
    fps: float | None = None

    @classmethod
    def of(cls, data_cfg, vae_config: dict) -> ClipShape:
        scale = int(vae_config.get("scale_factor_spatial", 8))
        fps = getattr(data_cfg, "fps", None)  # a run saved before data.fps has none: every frame_step-th frame
        return cls(
            pixel_frames(data_cfg.latent_frames, vae_config),
            int(data_cfg.frame_step),
            data_cfg.latent_height * scale,
            data_cfg.latent_width * scale,
            float(fps) if fps is not None else None,
        )

    def what(self, data_cfg) -> str:
        return (
            f"{self.frames} frames of {self.width}x{self.height} (data.latent_frames={data_cfg.latent_frames}, "
            f"latent {data_cfg.latent_width}x{data_cfg.latent_height}"
            + (f", 1 frame in {self.step}" if self.step > 1 else "")  # "every 2th frame" read wrong
            + (f", at data.fps={self.fps:g}" if self.fps else "")
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


def _pil_frames(path: Path) -> Iterator[tuple[Image.Image, float]]:
    """An animated GIF's or WebP's frames, each with the time it is shown at (seconds, from its durations)."""
    with Image.open(path) as video:
        if video.format not in ("GIF", "WEBP"):
            raise ValueError(f"a {video.format} image, not an animated GIF or WebP")
        time = 0.0
        for frame in ImageSequence.Iterator(video):
            # A copy, decoded in full here (truncated: raises), its alpha kept: a transparent first frame is refused
            # as a given image, as a transparent still is (conditions.opaque).
            yield frame.copy(), time
            time += (frame.info.get("duration") or 0) / 1000


def _av_frames(path: Path, key: str) -> Iterator[tuple[Image.Image, float]]:
    """A video's frames through PyAV, each with its presentation time (seconds)."""
    try:
        import av  # optional: MP4 and other containers
    except ImportError:
        raise UserError(
            f"{key}: {path.name} is a {path.suffix} video, which needs PyAV to decode; pip install av "
            f"(or give animated GIF or WebP files)"
        ) from None
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        for frame in _decoded(av, container):
            yield _av_image(frame), frame.time or 0.0  # a stream without timestamps: no times (data.fps refuses it)


def _decoded(av, container) -> Iterator:
    """The first video stream's frames. A VP9 WebM with alpha (`alpha_mode` 1) through libvpx's decoder: FFmpeg's
    own reads the colour alone and drops the alpha stored beside each frame."""
    stream = container.streams.video[0]
    if stream.codec_context.name == "vp9" and stream.metadata.get("alpha_mode") == "1":
        try:
            decoder = av.CodecContext.create("libvpx-vp9", "r")
        except Exception:  # a PyAV built without libvpx: the colour, as before
            decoder = None
        if decoder is not None:
            return (frame for packet in container.demux(stream) for frame in decoder.decode(packet))
    return container.decode(stream)


# FFmpeg's transpose filter's modes as PIL's (fftools turns a display matrix into these: ffmpeg_filter.c)
_TRANSPOSE = {
    "clock": Image.Transpose.ROTATE_270,
    "cclock": Image.Transpose.ROTATE_90,
    "cclock_flip": Image.Transpose.TRANSPOSE,
    "clock_flip": Image.Transpose.TRANSVERSE,
}


def _av_image(frame) -> Image.Image:
    """A decoded frame as a player shows it: upright and unmirrored by the display matrix a phone writes (PyAV
    decodes the sensor's orientation: a portrait clip came out lying down, and was cropped so), and its alpha kept
    where it has one (a ProRes 4444 or PNG MOV, a VP9 WebM), so that clear pixels go on black as a GIF's do
    (`conditions.rgb`) and a clear first frame is refused as a given image (`conditions.opaque`); to_image() dropped
    it, leaving whatever colour the encoder stored under them."""
    alpha = any(component.is_alpha for component in frame.format.components)
    image = Image.fromarray(frame.to_ndarray(format="rgba"), "RGBA") if alpha else frame.to_image()
    for step in _display_steps(frame):
        image = image.transpose(step) if isinstance(step, Image.Transpose) else image.rotate(step, expand=True)
    return image


def _display_steps(frame) -> list:
    """What turns a frame as its display matrix says, as ffmpeg's autorotate does (`theta` clockwise): a transpose
    or flips (PIL's), or an angle to rotate by (counterclockwise, PIL's). None without a matrix."""
    matrix = next((bytes(d) for d in frame.side_data if getattr(d.type, "name", "") == "DISPLAYMATRIX"), None)
    if matrix is None or len(matrix) != 36:
        return []
    m = struct.unpack("=9i", matrix)
    theta = -round(float(getattr(frame, "rotation", 0) or 0))
    theta -= 360 * math.floor(theta / 360 + 0.9 / 360)
    if abs(theta - 90) < 1:
        return [_TRANSPOSE["cclock_flip" if m[3] > 0 else "clock"]]
    if abs(theta - 180) < 1:
        return [
            t
            for t, flipped in ((Image.Transpose.FLIP_LEFT_RIGHT, m[0] < 0), (Image.Transpose.FLIP_TOP_BOTTOM, m[4] < 0))
            if flipped
        ]
    if abs(theta - 270) < 1:
        return [_TRANSPOSE["clock_flip" if m[3] < 0 else "cclock"]]
    if abs(theta) > 1:
        return [-theta]
    return [Image.Transpose.FLIP_TOP_BOTTOM] if m[4] < 0 else []


@dataclass
class _Picked:
    """A clip's frames as picked from a file, and what the refusals say of the file: the frames decoded, the last
    one's time from the first's (seconds), its usual interval between frames, and each frame picked more than once
    (at a data.fps above its rate, or across a gap in a variable-rate file)."""

    frames: list[Image.Image]
    decoded: int
    last: float
    interval: float  # the median interval between its frames (seconds); 0: no times
    repeated: int

    @property
    def rate(self) -> float | None:
        """Frames a second as it is stored: its usual interval's (a single gap in a phone's variable-rate clip aside);
        None where its frames carry no times (a GIF without durations)."""
        return 1 / self.interval if self.interval > 0 and self.last > 0 else None


def _pick(timed: Iterator[tuple[Image.Image, float]], shape: ClipShape) -> _Picked:
    """The clip's frames from a file's (frame, time)s, decoding no further than the clip: every `shape.step`-th
    frame from the first; or (`shape.fps`) at each k / fps seconds the frame shown then (the last to start by it),
    so files stored at 24, 30 or 60 fps give clips that move alike."""
    frames: list[Image.Image] = []
    times: list[float] = []
    shown, start = None, 0.0
    tolerance = 1e-3 if shape.fps is None else 0.25 / shape.fps  # container times are rounded (a GIF's to 10 ms)
    for image, at in timed:
        start = at if not times else start  # a file's first time need not be 0
        time = at - start
        times.append(time)
        if shape.fps is None:
            if (len(times) - 1) % shape.step == 0:
                frames.append(image)
        else:  # the times passed before this frame starts show the one before it
            while shown is not None and len(frames) < shape.frames and time > len(frames) / shape.fps + tolerance:
                frames.append(shown)
            shown = image
        if len(frames) == shape.frames:
            break
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    interval = gaps[len(gaps) // 2] if gaps else 0.0
    last = times[-1] if times else 0.0
    if shape.fps is not None:  # the last frame stays on screen one interval of the file's own, until it ends
        while shown is not None and len(frames) < shape.frames and len(frames) / shape.fps <= last + interval + 1e-3:
            frames.append(shown)
    return _Picked(frames, len(times), last, interval, len(frames) - len({id(f) for f in frames}))


def read_clip(source: VideoSource, i: int, shape: ClipShape, data_cfg, decoded: bool = False) -> list[Image.Image]:
    """Video i's clip (`_pick`) in RGB, transparent pixels on black as a still's (`conditions.rgb`; `decoded`: as
    decoded, alpha kept), refused in one line where it does not decode, is too short, is smaller than the frame
    size, or (at data.fps) is stored at a lower rate."""
    return _read(source, i, shape, data_cfg, decoded).frames


def _read(source: VideoSource, i: int, shape: ClipShape, data_cfg, decoded: bool = False) -> _Picked:
    path, name = source.files[i], source.name(i)
    try:
        timed = _pil_frames(path) if path.suffix.lower() in PIL_SUFFIXES else _av_frames(path, source.key)
        picked = _pick(timed, shape)
    except UserError:
        raise
    except Image.DecompressionBombError as e:  # a valid clip too large for PIL's guard, not a damaged one
        raise UserError(f"{source.key}: {name} {unreadable(e)}, or move it out of the folder") from None
    except Exception as e:  # PIL and PyAV raise many types for a damaged or foreign file; all mean the same here
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        # A decoder's own slip on a damaged stream (PyAV's "'NoneType' object has no attribute 'name'") says
        # nothing to the user: the file is what they can act on.
        said = "" if not reason or isinstance(e, (AttributeError, TypeError, KeyError, IndexError)) else f": {reason}"
        raise UserError(
            f"{source.key}: {name} is not a readable video (truncated or not a video{said[:122]}); replace or remove it"
        ) from None
    frames, fps = picked.frames, shape.fps
    if picked.decoded == 1 and shape.frames > 1:  # a still saved as a GIF or WebP: not a short clip
        raise UserError(
            f"{source.key}: {name} has one frame, a still, and data=video_folder takes clips; move it out of the "
            "folder (stills train with data=image_folder)"
        )
    if fps is not None and picked.rate is None and shape.frames > 1:
        raise UserError(
            f"{source.key}: {name} gives its frames no times (a GIF without durations, a stream without "
            "timestamps), which data.fps needs; give it them, or use data.frame_step instead of data.fps"
        )
    if len(frames) < shape.frames and fps is None:
        needed = (shape.frames - 1) * shape.step + 1
        raise UserError(
            f"{source.key}: {name} has {picked.decoded} frame(s), fewer than the {needed} a clip of "
            f"{shape.what(data_cfg)} takes; lower data.latent_frames"
            + (" or data.frame_step" if shape.step > 1 else "")
            + " or remove it"
        )
    if len(frames) < shape.frames and fps is not None:
        raise UserError(
            f"{source.key}: {name}'s {picked.decoded} frames span {picked.last:.2f} s, less than the "
            f"{(shape.frames - 1) / fps:.2f} s a clip of {shape.what(data_cfg)} takes; lower data.latent_frames or "
            "data.fps, or remove it"
        )
    # Slower than data.fps as stored (its usual interval): its frames repeat throughout. A gap in a phone's
    # variable-rate clip repeats one, as a player holds it: taken.
    if fps is not None and picked.repeated and picked.rate is not None and picked.rate < fps * 0.99:
        raise UserError(
            f"{source.key}: {name} is stored at {picked.rate:.3g} fps, fewer than data.fps={fps:g}: {picked.repeated} "
            "of its frames would show twice (none are made up); lower data.fps, or remove it"
        )
    width, height = frames[0].size
    if width < shape.width or height < shape.height:
        raise UserError(
            f"{source.key}: {name} is {width}x{height}, smaller than the {shape.width}x{shape.height} frames of "
            f"{shape.what(data_cfg)} (videos are scaled down and cropped, never up); give larger videos or "
            "lower data.latent_height/latent_width"
        )
    return picked if decoded else dataclasses.replace(picked, frames=[rgb(f) for f in frames])


def clip_pixels(frames: list[Image.Image], shape: ClipShape) -> torch.Tensor:
    """Frames scaled to cover the frame size, center-cropped, in [-1, 1]: [3, F, H, W]."""
    fitted = [ImageOps.fit(f, (shape.width, shape.height), method=Image.Resampling.BICUBIC) for f in frames]
    array = np.stack([np.asarray(f, dtype=np.float32) for f in fitted])  # [F, H, W, 3]
    return torch.from_numpy(array / 127.5 - 1.0).permute(3, 0, 1, 2)


def check_clips(data_cfg, vae_config: dict, given: bool = False) -> VideoSource:
    """Every video decodes into a whole clip of the run's shape, and (`given`: an image-to-video teacher's) its first
    frame can be a given image, opaque as a given still must be (the preflight calls this before anything heavy,
    once the teacher's VAE config is known). Files stored at different rates, taken frame by frame, are said."""
    source = folder_videos(data_cfg.root)
    shape = ClipShape.of(data_cfg, vae_config)
    rates = {}
    for i in range(len(source.files)):
        picked = _read(source, i, shape, data_cfg, decoded=given)
        if given:
            opaque(picked.frames[0], source.name(i), source.key)
        if picked.rate is not None:
            rates[source.name(i)] = picked.rate
    _said_rates(source.key, rates, shape)
    return source


def _said_rates(key: str, rates: dict[str, float], shape: ClipShape) -> None:
    """A warning, once a process, where files stored at rates more than 10% apart are taken frame by frame (no
    data.fps): their clips move at different speeds, which a student learns as one motion."""
    if shape.fps is not None or shape.frames < 2 or len(rates) < 2 or key in _SAID_RATES:
        return
    slow, fast = min(rates, key=rates.__getitem__), max(rates, key=rates.__getitem__)
    if rates[fast] > 1.1 * rates[slow]:
        _SAID_RATES.add(key)
        # A rate every file reaches (none shown twice): Wan 2.1/2.2's 16 where the slowest file has it.
        fps = "16, as Wan 2.1/2.2 were trained" if rates[slow] >= 16 else f"{math.floor(rates[slow])}, the slowest's"
        log.warning(
            "%s: its videos are stored at different frame rates (%s at %.3g fps, %s at %.3g fps), and taken frame by "
            "frame their clips move at different speeds; set data.fps (e.g. %s) to sample each at one rate",
            key,
            slow,
            rates[slow],
            fast,
            rates[fast],
            fps,
        )


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
    picked = [shape.step] + ([shape.fps] if shape.fps else [])  # without data.fps: the keys of before it
    blob = json.dumps([vae_id, source.fingerprint, list(latent_shape), *picked, PIXELS], sort_keys=True)
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
