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
