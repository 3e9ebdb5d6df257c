"""The pocket teacher's data: real handwritten digits, coloured and placed, with prompts naming all three.

The digits are the UCI optical-digits test set (1,797 labelled 8x8 images, 0..16) that scikit-learn ships as
`sklearn/datasets/data/digits.csv.gz`; the same file ships here (57 KB), so nothing needs scikit-learn.
Each digit is upsampled to 16x16, tinted one of `COLOURS` and put in the `POSITIONS` half of a black 32x32
canvas (jittered a little): "a red 3 on the left". Prompt adherence then needs all three attributes right,
so the text conditioning has to work. The first 80% of the digits train; the rest are held out (FID/KID).
"""

from __future__ import annotations

import gzip
import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

DIGITS_CSV = Path(__file__).resolve().parents[1] / "assets" / "pocket" / "digits.csv.gz"
COLOURS = {"red": (1.0, 0.15, 0.1), "green": (0.1, 0.9, 0.15), "blue": (0.2, 0.35, 1.0)}
POSITIONS = ("left", "right")
IMAGE_SIZE = 32
DIGIT_SIZE = 16
TRAIN_FRACTION = 0.8


@dataclass(frozen=True)
class Attributes:
    digit: int
    colour: int  # index into COLOURS
    position: int  # index into POSITIONS

    @property
    def prompt(self) -> str:
        return f"a {list(COLOURS)[self.colour]} {self.digit} on the {POSITIONS[self.position]}"


def all_attributes() -> list[Attributes]:
    """Every combination (60): the prompts the pocket teacher knows, in a fixed order."""
    return [Attributes(d, c, p) for d, c, p in itertools.product(range(10), range(len(COLOURS)), range(len(POSITIONS)))]


PROMPTS = [a.prompt for a in all_attributes()]
BY_PROMPT = {a.prompt: a for a in all_attributes()}


def prompt_file_order() -> list[str]:
    """The prompts in the order of the shipped prompts.txt: shuffled (seed 0), so that the last 10% a run
    holds out for validation and `eval` mix digits, colours and sides it has seen in other combinations."""
    return [PROMPTS[i] for i in torch.randperm(len(PROMPTS), generator=torch.Generator().manual_seed(0))]


def parse_prompt(prompt: str) -> Attributes | None:
    """The attributes a pocket prompt asks for; None for any other text."""
    return BY_PROMPT.get(" ".join(prompt.lower().split()))


def load_digits(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(images [N, 8, 8] in [0, 1], labels [N]) of the "train" or "heldout" split (a fixed cut, no shuffle)."""
    with gzip.open(DIGITS_CSV, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    images, labels = torch.from_numpy(table[:, :64] / 16.0).view(-1, 8, 8), torch.from_numpy(table[:, 64]).long()
    cut = int(len(labels) * TRAIN_FRACTION)
    return (images[:cut], labels[:cut]) if split == "train" else (images[cut:], labels[cut:])


def render(digits: torch.Tensor, colour: torch.Tensor, position: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[N, 8, 8] digits -> [N, 3, 32, 32] images in [0, 1]: upsampled, tinted, in their half, jittered."""
    n = len(digits)
    big = F.interpolate(digits[:, None], size=(DIGIT_SIZE, DIGIT_SIZE), mode="bilinear", align_corners=False)
    tint = torch.tensor(list(COLOURS.values()))[colour].view(n, 3, 1, 1)
    canvas = torch.zeros(n, 3, IMAGE_SIZE, IMAGE_SIZE)
    free = IMAGE_SIZE - DIGIT_SIZE
    ys = torch.randint(free // 2 - 4, free // 2 + 5, (n,), generator=g)
    xs = torch.randint(0, 4, (n,), generator=g) + position * (free - 3)
    for i in range(n):
        y, x = int(ys[i]), int(xs[i])
        canvas[i, :, y : y + DIGIT_SIZE, x : x + DIGIT_SIZE] = big[i, 0].clamp(0, 1) * tint[i]
    return canvas


def random_attributes(labels: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A colour and a position for each digit, drawn uniformly."""
    n = len(labels)
    return torch.randint(len(COLOURS), (n,), generator=g), torch.randint(len(POSITIONS), (n,), generator=g)


def rendered_split(split: str, copies: int = 1, seed: int = 0):
    """(images [N*copies, 3, 32, 32] in [0, 1], digit, colour, position labels, prompts), fixed by `seed`."""
    digits, labels = load_digits(split)
    g = torch.Generator().manual_seed(seed)
    digits, labels = digits.repeat(copies, 1, 1), labels.repeat(copies)
    colour, position = random_attributes(labels, g)
    images = render(digits, colour, position, g)
    prompts = [Attributes(int(d), int(c), int(p)).prompt for d, c, p in zip(labels, colour, position)]
    return images, labels, colour, position, prompts
