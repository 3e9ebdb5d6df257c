"""wandistiller/evaluation/grids.py: the teacher | student grid read back pixel by pixel, and written whole."""

from __future__ import annotations

import numpy as np
from PIL import Image

from wandistiller.evaluation.grids import CELL, save_grid

HEADER, CAPTION = 24, 36  # the column titles' band above the rows and each row's caption band


def quadrants(top_left, top_right, bottom_left, bottom_right) -> np.ndarray:
    """A 2x2 image of four RGB colours (floats, as the pipeline returns them)."""
    return np.array([[top_left, top_right], [bottom_left, bottom_right]], dtype=np.float32)


def test_each_row_is_the_teachers_then_the_students_image_scaled_up_unblurred_and_captioned(tmp_path):
    red, green, blue, black = (1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 0, 0)
    teacher = np.stack([quadrants(red, green, blue, black), quadrants(black, black, black, black)])
    student = np.stack([quadrants(blue, blue, blue, blue), quadrants(green, red, green, red)])
    path = save_grid(teacher, student, ["a red fox", "a boat"], tmp_path / "grid.png")
    grid = np.asarray(Image.open(path).convert("RGB"))
    assert grid.shape == (HEADER + 2 * (CELL + CAPTION), 2 * CELL, 3)
    half = CELL // 2  # each source pixel covers a CELL/2 square: nearest, not interpolated
    first, second = HEADER, HEADER + CELL + CAPTION
    expected = {
        (first + 1, 1): red, (first + 1, half + 1): green, (first + half + 1, 1): blue,  # teacher, row 1
        (first + CELL - 1, half): black,
        (first + 1, CELL + 1): blue, (first + CELL - 1, 2 * CELL - 1): blue,  # student, row 1
        (second + 1, 1): black,  # teacher, row 2
        (second + 1, CELL + 1): green, (second + 1, CELL + half + 1): red,  # student, row 2
    }  # fmt: skip
    for (y, x), colour in expected.items():
        assert tuple(grid[y, x]) == tuple(255 * c for c in colour), (y, x)
    captions = grid[first + CELL : second]  # the first row's caption band: white with dark text in it
    assert (captions == 255).mean() > 0.9 and (captions < 128).any()


def test_values_outside_zero_to_one_are_clipped_not_wrapped(tmp_path):
    over, under = np.full((1, 2, 2, 3), 1.7, np.float32), np.full((1, 2, 2, 3), -0.4, np.float32)
    grid = np.asarray(Image.open(save_grid(over, under, ["p"], tmp_path / "g.png")).convert("RGB"))
    assert tuple(grid[HEADER + 1, 1]) == (255, 255, 255) and tuple(grid[HEADER + 1, CELL + 1]) == (0, 0, 0)


def test_a_grid_that_cannot_be_written_whole_leaves_the_old_one_and_no_empty_file(tmp_path):
    import subprocess
    import sys

    (tmp_path / "grid.png").write_bytes(b"the old grid")
    code = """
import resource, signal, sys
import numpy as np
from pathlib import Path
from wandistiller.evaluation.grids import save_grid
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))  # a disk that fills after 1000 bytes of any file
try:
    save_grid(np.zeros((2, 8, 8, 3)), np.ones((2, 8, 8, 3)), ["a", "b"], Path(sys.argv[1]) / "grid.png")
except OSError as e:
    print(e.strerror)
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "File too large", out.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == ["grid.png"] and (
        tmp_path / "grid.png"
    ).read_bytes() == b"the old grid"
