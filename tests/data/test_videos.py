"""wandistiller/data/videos.py, called directly: a captioned folder of animated GIF / WebP clips read as the first
(latent_frames - 1) x 4 + 1 frames (every frame_step-th), scaled down to cover the frame size and center-cropped
into [3, F, H, W] pixels in [-1, 1]; each file it cannot use is one line naming it and the fix."""

from __future__ import annotations

import logging
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from tests.conftest import refused
from wandistiller.core.arch import Layout
from wandistiller.core.errors import UserError
from wandistiller.data.conditions import rgb
from wandistiller.data.sources.videos import Videos
from wandistiller.data.videos import (
    ClipShape,
    check_clips,
    clip_pixels,
    folder_videos,
    held_out_first_frames,
    read_clip,
)

CAPTIONS = ["a red square moving right", "a blue square moving down", "a green square moving left"]
WAN_VAE = {"scale_factor_spatial": 8, "scale_factor_temporal": 4, "temperal_downsample": [False, True, True]}


def clip(n: int, size: tuple[int, int] = (80, 64), colour=(220, 40, 40), dx: int = 4, dy: int = 0) -> list[Image.Image]:
    """`n` frames of a square moving by (dx, dy) a frame over a grey ground: every frame differs."""
    frames = []
    for k in range(n):
        a = np.full((size[1], size[0], 3), 90, np.uint8)
        x, y = (8 + k * dx) % (size[0] - 16), (8 + k * dy) % (size[1] - 16)
        a[y : y + 16, x : x + 16] = colour
        frames.append(Image.fromarray(a))
    return frames


def save(frames: list[Image.Image], path: Path, caption: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=62, loop=0)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)
    return path


def write_videos(root: Path, frames: int = 9) -> Path:
    """Three captioned clips of `frames` frames of 80x64: two GIFs and an animated WebP."""
    save(clip(frames), root / "a.gif", CAPTIONS[0])
    save(clip(frames, colour=(40, 40, 220), dx=0, dy=4), root / "b.webp", CAPTIONS[1])
    save(clip(frames, colour=(40, 220, 40), dx=-4), root / "c.gif", CAPTIONS[2])
    return root


def data_cfg(root: Path, latent_frames: int = 3, step: int = 1, latent: int = 8) -> SimpleNamespace:
    return SimpleNamespace(root=str(root), latent_frames=latent_frames, latent_height=latent, latent_width=latent,
                           frame_step=step)  # fmt: skip


def test_a_folder_reads_as_captioned_clips_of_the_vaes_length_scaled_down_and_cropped(tmp_path):
    root = write_videos(tmp_path / "clips", frames=20)
    source = check_clips(data_cfg(root), WAN_VAE)
    assert source.captions == CAPTIONS and [source.name(i) for i in range(3)] == ["a.gif", "b.webp", "c.gif"]
    shape = ClipShape.of(data_cfg(root), WAN_VAE)
    assert (shape.frames, shape.height, shape.width) == (9, 64, 64)  # 3 latent frames: 1 + 2 x 4; 8 x 8 latents
    pixels = clip_pixels(read_clip(source, 0, shape, data_cfg(root)), shape)
    assert pixels.shape == (3, 9, 64, 64) and -1 <= pixels.min() and pixels.max() <= 1
    assert not torch.equal(pixels[:, 0], pixels[:, 1])  # the square moved
    stepped = ClipShape.of(data_cfg(root, step=2), WAN_VAE)  # every 2nd frame of the first 17
    frames = read_clip(source, 0, stepped, data_cfg(root, step=2))
    assert len(frames) == 9 and np.array_equal(np.asarray(frames[1]), np.asarray(clip(20)[2].convert("RGB")))


def test_one_latent_frame_is_one_frame_and_a_still_gif_serves_it(tmp_path, caplog):
    root = tmp_path / "stills"
    save(clip(1), root / "a.gif", "a red square")
    assert len(read_clip(folder_videos(str(root)), 0, ClipShape.of(data_cfg(root, 1), WAN_VAE), data_cfg(root, 1))) == 1
    # said, as the run checks its source: a video folder at one latent frame trains on stills (an audit's)
    with caplog.at_level(logging.WARNING, logger="wandistiller"):
        Videos.check(OmegaConf.create(vars(data_cfg(root, 1))))
        assert "data.latent_frames=1 trains on each video's first frame alone, a still" in caplog.text
        caplog.clear()
        Videos.check(OmegaConf.create(vars(data_cfg(root, 3))))
        assert "first frame alone" not in caplog.text


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda r: (r / "b.webp").write_text("not a video"),
            "b.webp is not a readable video (truncated or not a video",
        ),
        (lambda r: (r / "a.gif").write_bytes((r / "a.gif").read_bytes()[:300]), "a.gif is not a readable video"),
        (lambda r: (r / "b.webp").write_bytes((r / "b.webp").read_bytes()[:400]), "b.webp is not a readable video"),
        (lambda r: clip(1)[0].save(r / "a.gif", format="PNG"), "a PNG image, not an animated GIF or WebP"),
        (lambda r: save(clip(5), r / "c.gif"), "c.gif has 5 frame(s), fewer than the 9 a clip of 9 frames of 64x64"),
        (lambda r: save(clip(9, size=(48, 80)), r / "c.gif"), "c.gif is 48x80, smaller than the 64x64 frames"),
        (lambda r: (r / "c.txt").unlink(), "c.gif has no caption (no c.txt beside it); caption every video"),
        (lambda r: (r / "c.txt").write_text(" "), "c.gif has no caption (c.txt beside it is empty); caption every"),
    ],
)
def test_a_file_it_cannot_use_is_one_line_naming_it(tmp_path, edit, message):
    root = write_videos(tmp_path / "clips")
    edit(root)
    with refused(message):
        check_clips(data_cfg(root), WAN_VAE)


def test_an_empty_folder_or_one_of_stills_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with refused("holds no videos (.gif, .webp, .mp4"):
        folder_videos(str(tmp_path / "empty"))
    (tmp_path / "stills").mkdir()
    clip(1)[0].save(tmp_path / "stills" / "a.png")
    with refused("it holds images: use data=image_folder"):
        folder_videos(str(tmp_path / "stills"))
    with refused("is not a folder; give a folder of videos with captions"):
        folder_videos(str(tmp_path / "none"))


def test_a_still_among_the_clips_is_one_line_naming_it(tmp_path):
    root = write_videos(tmp_path / "clips")
    clip(1)[0].save(root / "poster.jpg")  # dropped unread before: named instead, as image_folder names a clip
    with refused(
        "poster.jpg is a still image, and data=video_folder takes clips (an image-to-video teacher's given image is "
        "each clip's first frame); for stills use data=image_folder, or move it out of the folder"
    ):
        folder_videos(str(root))


@pytest.mark.parametrize("name", ["d.gif", "d.webp"])
def test_a_clip_of_one_frame_is_named_a_still_not_a_short_clip(tmp_path, name):
    """A still saved as a GIF or WebP among the clips: "lower data.latent_frames" would make the whole run stills."""
    root = write_videos(tmp_path / "clips")
    save(clip(1), root / name, "a still")
    with refused(f"{name} has one frame, a still, and data=video_folder takes clips; move it out of the folder"):
        check_clips(data_cfg(root), WAN_VAE)


def clear_first(frames: list[Image.Image]) -> list[Image.Image]:
    """`frames` with alpha, the first with a transparent corner (its colour kept under it)."""
    out = [f.convert("RGBA") for f in frames]
    out[0].putalpha(Image.fromarray(np.where(np.arange(64)[:, None] < 8, 0, 255).repeat(80, 1).astype(np.uint8)))
    return out


@pytest.mark.parametrize("name", ["b.webp", "a.gif"])
def test_a_clip_whose_first_frame_is_transparent_is_refused_as_a_given_image_and_read_as_a_still_for_x0(tmp_path, name):
    """A transparent first frame given to an image-to-video teacher is refused as a transparent still is (it was
    silently flattened to RGB); as x0 its RGB is what a text-to-video teacher's still gives (alpha dropped alike)."""
    root = write_videos(tmp_path / "clips")
    frames = clear_first(clip(9))
    frames[0].save(root / name, save_all=True, append_images=frames[1:], duration=62, loop=0, lossless=True)
    cfg = data_cfg(root)
    with refused(f"{name} has transparent pixels (mode "):
        Videos.check_with_teacher(cfg, WAN_VAE, Layout.i2v)
    with refused(f"{name} has transparent pixels (mode ") as e:
        held_out_first_frames(cfg, WAN_VAE, 3)  # an evaluation's given first frames, the training's too
    assert e.value.args[0].endswith("which a first frame cannot show; flatten it onto a background (save it as RGB)")
    Videos.check_with_teacher(cfg, WAN_VAE, Layout.t2v)  # x0 alone: taken, its clear pixels on black as a still's
    source, shape = folder_videos(str(root)), ClipShape.of(cfg, WAN_VAE)
    first = np.asarray(read_clip(source, ["a.gif", "b.webp", "c.gif"].index(name), shape, cfg)[0])
    frames[0].save(tmp_path / "still.png")  # the colour stays under its clear pixels: black all the same
    assert np.array_equal(first, np.asarray(rgb(Image.open(tmp_path / "still.png"))))
    assert first[:8].max() == 0 and first[8:].min() > 0  # the clear rows black, the rest as drawn


def save_av(frames: list[Image.Image], path: Path, caption: str, codec="mpeg4", pix_fmt="yuv420p", rate=16) -> Path:
    """`frames` written by PyAV (FFmpeg's encoders) at `rate` fps, as a camera or an editor writes MP4 / MOV."""
    av = pytest.importorskip("av")  # a dev dependency; optional for users
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = frames[0].width, frames[0].height, pix_fmt
        for frame in frames:
            image = frame if frame.mode in ("RGB", "RGBA") else frame.convert("RGB")
            pixels = av.VideoFrame.from_ndarray(np.asarray(image), format={"RGB": "rgb24", "RGBA": "rgba"}[image.mode])
            out.mux(stream.encode(pixels))
        out.mux(stream.encode())
    path.with_suffix(".txt").write_text(caption)
    return path


def held_sideways(path: Path) -> None:
    """`path`'s track matrix set as a phone sets it for a portrait clip: shown turned a quarter clockwise."""
    data = bytearray(path.read_bytes())
    at = data.find(b"tkhd") + 4 + 4 + 20 + 8 + 8  # version 0: flags, times, track id, duration; reserved, layer...
    assert struct.unpack(">9i", data[at : at + 36]) == (1 << 16, 0, 0, 0, 1 << 16, 0, 0, 0, 1 << 30)  # identity
    height = struct.unpack(">I", data[at + 40 : at + 44])[0] >> 16
    data[at : at + 36] = struct.pack(">9i", 0, 1 << 16, 0, -(1 << 16), 0, 0, height << 16, 0, 1 << 30)
    path.write_bytes(data)


def test_an_mp4_reads_as_its_frames_and_a_phones_portrait_clip_upright(tmp_path):
    """The PyAV path, which most users' videos take: the frames as drawn (within the codec's loss), and a clip a
    phone recorded held upright (its frames stored lying down, a display matrix saying so) read upright, as a
    player shows it and as a still's EXIF orientation is read; it was read lying down and cropped so."""
    root = write_videos(tmp_path / "clips")
    save_av(clip(9), root / "d.mp4", "a red square moving right")
    cfg = data_cfg(root)
    source, shape = check_clips(cfg, WAN_VAE), ClipShape.of(cfg, WAN_VAE)
    frames = read_clip(source, source.files.index(root / "d.mp4"), shape, cfg)
    drawn = [np.asarray(f, np.float32) for f in clip(9)]
    assert len(frames) == 9 and all(np.abs(np.asarray(f, np.float32) - d).mean() < 4 for f, d in zip(frames, drawn))
    tall = [Image.fromarray(np.asarray(f)[:, 8:72]) for f in clip(9, dx=0, dy=3)]  # 64 wide, 64 high: turned below
    tall = [Image.fromarray(np.concatenate([np.asarray(f), np.full((16, 64, 3), 250, np.uint8)])) for f in tall]
    held_sideways(save_av([f.rotate(90, expand=True) for f in tall], root / "e.mp4", "a red square moving down"))
    frames = read_clip(check_clips(cfg, WAN_VAE), 4, shape, cfg, decoded=True)  # a, b, c, d, e
    assert frames[0].size == (64, 80)  # upright: portrait, as recorded
    assert np.abs(np.asarray(frames[0], np.float32) - np.asarray(tall[0], np.float32)).mean() < 4


@pytest.mark.parametrize(
    "codec,pix_fmt,name",
    [("qtrle", "argb", "d.mov"), ("prores_ks", "yuva444p10le", "d.mov"), ("libvpx-vp9", "yuva420p", "d.webm")],
)
def test_a_clip_with_alpha_is_read_as_a_transparent_gif_is(tmp_path, codec, pix_fmt, name):
    """An editor's clip with alpha (QuickTime RLE, ProRes 4444, VP9 WebM): its clear pixels on black as a GIF's,
    and a clear first frame refused as a given image; PyAV's to_image() dropped the alpha, showing the colour under
    it, and FFmpeg's own VP9 decoder reads a WebM's colour alone."""
    root = write_videos(tmp_path / "clips")
    save_av(clear_first(clip(9)), root / name, "a red square moving right", codec, pix_fmt)
    cfg = data_cfg(root)
    with refused(f"{name} has transparent pixels (mode "):
        Videos.check_with_teacher(cfg, WAN_VAE, Layout.i2v)
    Videos.check_with_teacher(cfg, WAN_VAE, Layout.t2v)
    first = np.asarray(read_clip(folder_videos(str(root)), 3, ClipShape.of(cfg, WAN_VAE), cfg)[0], np.float32)
    assert first[:8].max() < 4 and first[8:].min() > 25  # the clear rows black, the rest as drawn


def test_a_damaged_mp4_is_one_line_naming_it(tmp_path):
    root = write_videos(tmp_path / "clips")
    path = save_av(clip(9), root / "d.mp4", "a red square moving right")
    path.write_bytes(path.read_bytes()[:600])  # cut short in a copy
    with refused("d.mp4 is not a readable video (truncated or not a video"):
        check_clips(data_cfg(root), WAN_VAE)
    whole = save_av(clip(9), root / "d.mp4", "a red square moving right").read_bytes()
    path.write_bytes(whole[: len(whole) * 2 // 3])  # its last third cut: PyAV's own slip was the reason given
    with pytest.raises(UserError) as e:
        check_clips(data_cfg(root), WAN_VAE)
    assert "d.mp4 is not a readable video (truncated or not a video" in str(e.value) and "NoneType" not in str(e.value)


def test_a_clip_too_large_for_pil_is_told_to_be_scaled_down_not_called_damaged(tmp_path, monkeypatch):
    root = write_videos(tmp_path / "clips")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # PIL refuses over twice this: a 64x64 frame is a "bomb"
    with refused("a.gif is too large for PIL to decode (Image size (5120 pixels) exceeds limit of 200 pixels, a guard"):
        check_clips(data_cfg(root), WAN_VAE)


def at_fps(root: Path, fps: float | None, latent_frames: int = 3) -> SimpleNamespace:
    cfg = data_cfg(root, latent_frames)
    cfg.fps = fps
    return cfg


def test_data_fps_samples_each_file_at_one_rate_whatever_it_is_stored_at(tmp_path):
    """A 32 fps MP4 beside 16 fps GIFs: at data.fps=16 its clip is every other frame, spanning the same half second
    as theirs (frame by frame it spanned a quarter, moving twice as fast); the GIFs' clips are their frames."""
    root = write_videos(tmp_path / "clips")
    save_av(clip(17, dx=2), root / "d.mp4", "a red square moving right", rate=32)
    cfg = at_fps(root, 16)
    source, shape = check_clips(cfg, WAN_VAE), ClipShape.of(cfg, WAN_VAE)
    gif = read_clip(source, 0, shape, cfg)
    assert all(np.array_equal(np.asarray(f), np.asarray(d.convert("RGB"))) for f, d in zip(gif, clip(9)))
    mp4 = [np.asarray(f, np.float32) for f in read_clip(source, 3, shape, cfg)]
    assert len(mp4) == 9 and all(
        np.abs(f - np.asarray(d, np.float32)).mean() < 4 for f, d in zip(mp4, clip(17, dx=2)[::2])
    )
    assert "at data.fps=16" in shape.what(cfg)


def test_mixed_frame_rates_taken_frame_by_frame_are_said_once(tmp_path, caplog):
    root = write_videos(tmp_path / "clips")
    with caplog.at_level(logging.WARNING):
        check_clips(data_cfg(root), WAN_VAE)
    assert not caplog.records  # one rate: nothing to say
    save_av(clip(17), root / "d.mp4", "a red square moving right", rate=32)
    with caplog.at_level(logging.WARNING):
        check_clips(data_cfg(root), WAN_VAE)
        check_clips(data_cfg(root), WAN_VAE)  # read again in the same run: said once
        check_clips(at_fps(root, 16), WAN_VAE)  # one rate asked for: nothing to say
    (line,) = [r.getMessage() for r in caplog.records]
    assert "its videos are stored at different frame rates (b.webp at 16.1 fps, d.mp4 at 32 fps)" in line, line
    assert line.endswith("set data.fps (e.g. 16, as Wan 2.1/2.2 were trained) to sample each at one rate")


@pytest.mark.parametrize(
    "fps,edit,message",
    [
        (32, None, "a.gif is stored at 16.7 fps, fewer than data.fps=32: 4 of its frames would show twice (none are"),
        (8, None, "a.gif's 9 frames span 0.48 s, less than the 1.00 s a clip of 9 frames of 64x64 (data.latent_frames"),
        (16, lambda r: clip(9)[0].save(r / "a.gif", save_all=True, append_images=clip(9)[1:], duration=0),
         "a.gif gives its frames no times (a GIF without durations, a stream without timestamps), which data.fps"),
    ],
)  # fmt: skip
def test_a_file_data_fps_cannot_sample_is_one_line_naming_it(tmp_path, fps, edit, message):
    """Slower than data.fps: its frames would repeat (a clip that stutters), as a small video is never scaled up."""
    root = write_videos(tmp_path / "clips")
    if edit is not None:
        edit(root)
    with refused(message):
        check_clips(at_fps(root, fps), WAN_VAE)


def test_a_mirrored_display_matrix_mirrors_the_clip(tmp_path):
    """A front camera's or an editor's mirrored clip: PyAV says rotation -180 for it, and turning it so put it upside
    down; ffmpeg's autorotate (and a player) mirrors it."""
    root = write_videos(tmp_path / "clips")
    path = save_av(clip(9), root / "d.mp4", "a red square moving right")
    data = bytearray(path.read_bytes())
    at = data.find(b"tkhd") + 4 + 4 + 20 + 8 + 8
    data[at : at + 36] = struct.pack(">9i", -(1 << 16), 0, 0, 0, 1 << 16, 0, 80 << 16, 0, 1 << 30)
    path.write_bytes(data)
    cfg = data_cfg(root)
    first = np.asarray(read_clip(check_clips(cfg, WAN_VAE), 3, ClipShape.of(cfg, WAN_VAE), cfg)[0], np.float32)
    mirrored = np.asarray(clip(9)[0], np.float32)[:, ::-1]
    assert np.abs(first - mirrored).mean() < 4


def test_data_fps_takes_a_gap_in_a_variable_rate_clip_and_a_clip_of_just_the_span(tmp_path):
    """A phone's 30 fps clip with one 100 ms gap was refused as "stored at 24.5 fps, fewer than data.fps=24"; a
    30 fps clip of exactly 2 s, whose last frame starts at 1.967 s, as "less than the 2.00 s" it spans."""
    av = pytest.importorskip("av")
    root = tmp_path / "clips"
    root.mkdir()
    with av.open(str(root / "gap.mp4"), "w") as out:
        stream = out.add_stream("mpeg4", rate=30)
        stream.width, stream.height, stream.pix_fmt = 80, 64, "yuv420p"
        for k, frame in enumerate(clip(20)):
            picture = av.VideoFrame.from_ndarray(np.asarray(frame), format="rgb24")
            picture.pts = k + (3 if k >= 6 else 0)  # frames 6.. start 100 ms late: a dropped stretch
            out.mux(stream.encode(picture))
        out.mux(stream.encode())
    (root / "gap.txt").write_text("a red square moving right")
    cfg = at_fps(root, 24)  # 9 frames over a third of a second: one of them the frame held over the gap
    assert len(read_clip(check_clips(cfg, WAN_VAE), 0, ClipShape.of(cfg, WAN_VAE), cfg)) == 9
    save_av(clip(60), root / "two.mp4", "a red square moving right", rate=30)
    (root / "gap.mp4").unlink()
    (root / "gap.txt").unlink()
    cfg = at_fps(root, 16, latent_frames=9)  # 33 frames at 16 fps: 2 s, the file's whole length
    assert len(read_clip(check_clips(cfg, WAN_VAE), 0, ClipShape.of(cfg, WAN_VAE), cfg)) == 33


def test_the_mixed_rates_warning_suggests_a_rate_every_file_reaches(tmp_path, caplog):
    root = tmp_path / "clips"
    save_av(clip(9), (root / "slow.mp4") if root.mkdir() is None else root, "a red square", rate=10)
    save_av(clip(9), root / "fast.mp4", "a red square", rate=30)
    with caplog.at_level(logging.WARNING):
        check_clips(data_cfg(root), WAN_VAE)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "set data.fps (e.g. 10, the slowest's) to sample each at one rate" in line, line
