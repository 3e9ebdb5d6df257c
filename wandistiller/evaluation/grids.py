"""The teacher | student grid of sample images with their prompts, as a PNG written whole into a run folder: the
sample grids' (recipe/samples.py) and the evaluation's."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from wandistiller.core.files import write_in_run

CELL = 192  # pixels per sample in the grid, so tiny teachers' 64-pixel samples stay visible


def save_grid(
    teacher_imgs: np.ndarray, student_imgs: np.ndarray, prompts: list[str], path: Path, root: Path | None = None
) -> Path:
    """The teacher | student grid as a PNG at `path`, written whole into the run folder `root` (a link in its
    place is replaced, never written through; see core.files)."""

    header, caption = 24, 36
    grid = Image.new("RGB", (2 * CELL, header + len(prompts) * (CELL + caption)), "white")
    pen = ImageDraw.Draw(grid)
    pen.text((8, 6), "teacher", fill="black")
    pen.text((CELL + 8, 6), "student", fill="black")
    for row, (a, b, prompt) in enumerate(zip(teacher_imgs, student_imgs, prompts)):
        top = header + row * (CELL + caption)
        for col, img in enumerate((a, b)):
            pixels = Image.fromarray((np.clip(img, 0, 1) * 255).round().astype(np.uint8))
            grid.paste(pixels.resize((CELL, CELL), Image.Resampling.NEAREST), (col * CELL, top))
        pen.text((6, top + CELL + 3), "\n".join(textwrap.wrap(prompt, 60)[:2]), fill="black")
    path = Path(path)
    write_in_run(root or path.parent, path if root else path.name, write=lambda f: grid.save(f, format="png"))
    return path


FRAME_CELL = 96  # pixels per frame in a clip's animation (a 32-pixel frame x3)
STRIP_CELL = 48  # pixels per frame in the still strip (17 frames in a row stay under 820 pixels wide)
FRAME_MS = 120  # each frame's time in the animation (17 frames: about 2 s a loop)


def _frame(img: np.ndarray, side: int) -> Image.Image:
    return Image.fromarray((np.clip(img, 0, 1) * 255).round().astype(np.uint8)).resize(
        (side, side), Image.Resampling.NEAREST
    )


def clip_animation(teacher_clips: np.ndarray, student_clips: np.ndarray, prompts: list[str]) -> list[Image.Image]:
    """The frames of a teacher | student animation of [N, F, H, W, 3] clips in [0, 1], each prompt above its pair."""
    header, caption = 24, 30
    frames = []
    for f in range(teacher_clips.shape[1]):
        sheet = Image.new("RGB", (2 * FRAME_CELL, header + len(prompts) * (caption + FRAME_CELL)), "white")
        pen = ImageDraw.Draw(sheet)
        pen.text((8, 6), "teacher", fill="black")
        pen.text((FRAME_CELL + 8, 6), "student", fill="black")
        for row, (a, b, prompt) in enumerate(zip(teacher_clips, student_clips, prompts)):
            top = header + row * (caption + FRAME_CELL)
            pen.text((4, top + 2), "\n".join(textwrap.wrap(prompt, 30)[:2]), fill="black")
            sheet.paste(_frame(a[f], FRAME_CELL), (0, top + caption))
            sheet.paste(_frame(b[f], FRAME_CELL), (FRAME_CELL, top + caption))
        frames.append(sheet)
    return frames


def clip_strip(teacher_clips: np.ndarray, student_clips: np.ndarray, prompts: list[str]) -> Image.Image:
    """The still strip (for the docs): per prompt, its text, then the teacher's frames in a row and the student's."""
    n_frames, label, caption = teacher_clips.shape[1], 56, 18
    block = caption + 2 * STRIP_CELL
    strip = Image.new("RGB", (label + n_frames * STRIP_CELL, len(prompts) * block), "white")
    pen = ImageDraw.Draw(strip)
    for row, (a, b, prompt) in enumerate(zip(teacher_clips, student_clips, prompts)):
        top = row * block
        pen.text((4, top + 3), prompt, fill="black")
        for k, (who, clip) in enumerate((("teacher", a), ("student", b))):
            y = top + caption + k * STRIP_CELL
            pen.text((4, y + STRIP_CELL // 2 - 6), who, fill="black")
            for f in range(n_frames):
                strip.paste(_frame(clip[f], STRIP_CELL), (label + f * STRIP_CELL, y))
    return strip


def save_clip_grid(
    teacher_clips: np.ndarray, student_clips: np.ndarray, prompts: list[str], path: Path, root: Path | None = None
) -> tuple[Path, Path]:
    """A clip run's grid: `path` (a .png) the still strip, and beside it `<stem>.gif`, the animated teacher | student
    clips with their prompts above; each written whole into the run folder `root` (core.files). [N, F, H, W, 3]."""
    path = Path(path)
    gif = path.with_suffix(".gif")
    frames = clip_animation(teacher_clips, student_clips, prompts)
    strip = clip_strip(teacher_clips, student_clips, prompts)

    def animated(f) -> None:
        frames[0].save(f, format="gif", save_all=True, append_images=frames[1:], duration=FRAME_MS, loop=0)

    folder = root or path.parent
    write_in_run(folder, gif if root else gif.name, write=animated)
    write_in_run(folder, path if root else path.name, write=lambda f: strip.save(f, format="png"))
    return path, gif


def save_clip(clip: np.ndarray, prompt: str, path: Path, root: Path) -> tuple[Path, Path]:
    """One clip [F, H, W, 3] in [0, 1]: `path` (a .gif) animated with its prompt above, and `<stem>.png` its still
    strip (frames in a row), each written whole into `root` (core.files)."""
    caption = 30
    width = max(FRAME_CELL, 6 * len(prompt) + 8)
    frames = []
    for f in range(clip.shape[0]):
        sheet = Image.new("RGB", (width, caption + FRAME_CELL), "white")
        ImageDraw.Draw(sheet).text((4, 8), prompt, fill="black")
        sheet.paste(_frame(clip[f], FRAME_CELL), ((width - FRAME_CELL) // 2, caption))
        frames.append(sheet)
    strip = Image.new("RGB", (clip.shape[0] * STRIP_CELL, 18 + STRIP_CELL), "white")
    ImageDraw.Draw(strip).text((4, 3), prompt, fill="black")
    for f in range(clip.shape[0]):
        strip.paste(_frame(clip[f], STRIP_CELL), (f * STRIP_CELL, 18))
    path = Path(path)

    def animated(out) -> None:
        frames[0].save(out, format="gif", save_all=True, append_images=frames[1:], duration=FRAME_MS, loop=0)

    gif = write_in_run(root, path.name, write=animated)
    png = write_in_run(root, path.with_suffix(".png").name, write=lambda out: strip.save(out, format="png"))
    return gif, png
