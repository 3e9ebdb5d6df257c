"""The pocket teacher's data: real handwritten digits, coloured, with prompts naming both.

The digits are the UCI optical-digits test set (1,797 labelled 8x8 images, 0..16) that scikit-learn ships as
`sklearn/datasets/data/digits.csv.gz`; the same file ships here (57 KB), so nothing needs scikit-learn.
Each digit is upsampled to 28x28, tinted one of `COLOURS` and put on a black 32x32 canvas (jittered a
little): "a red 3". Prompt adherence then needs both attributes right, so the text conditioning has to work.
The digit fills the canvas on purpose: through the VAE (/4) and the transformer's 2x2 patches it is then
drawn in about 12 of the 16 tokens. A 16 px digit in one half of the canvas (tried, with the side asked
for too) got 2x2 tokens: colour and side were always right, the digit only 18% of the time.
The first 80% of the digits train; the rest are held out (FID/KID).
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
COLOURS = {"red": (1.0, 0.15, 0.1), "green": (0.1, 0.9, 0.15), "blue": (0.2, 0.35, 1.0), "yellow": (1.0, 0.85, 0.1)}
IMAGE_SIZE = 32
DIGIT_SIZE = 28
TRAIN_FRACTION = 0.8


@dataclass(frozen=True)
class Attributes:
    digit: int
    colour: int  # index into COLOURS

    @property
    def prompt(self) -> str:
        return f"a {list(COLOURS)[self.colour]} {self.digit}"

    @property
    def labels(self) -> tuple[int, int]:
        """What the judge reads off an image, in the order of its heads."""
        return self.digit, self.colour


ATTRIBUTE_NAMES = ("digit", "colour")


def all_attributes() -> list[Attributes]:
    """Every combination (40): the prompts the pocket teacher knows, in a fixed order."""
    return [Attributes(d, c) for d, c in itertools.product(range(10), range(len(COLOURS)))]


PROMPTS = [a.prompt for a in all_attributes()]
BY_PROMPT = {a.prompt: a for a in all_attributes()}


def prompt_file_order() -> list[str]:
    """The prompts in the order of the shipped prompts.txt: shuffled (seed 0), so that the last 10% a run
    holds out for validation and `eval` mix digits and colours it has seen in other combinations."""
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


def render(digits: torch.Tensor, colour: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[N, 8, 8] digits -> [N, 3, 32, 32] images in [0, 1]: upsampled, tinted, jittered."""
    n = len(digits)
    big = F.interpolate(digits[:, None], size=(DIGIT_SIZE, DIGIT_SIZE), mode="bilinear", align_corners=False)
    tint = torch.tensor(list(COLOURS.values()))[colour].view(n, 3, 1, 1)
    canvas = torch.zeros(n, 3, IMAGE_SIZE, IMAGE_SIZE)
    free = IMAGE_SIZE - DIGIT_SIZE
    ys = torch.randint(0, free + 1, (n,), generator=g)
    xs = torch.randint(0, free + 1, (n,), generator=g)
    for i in range(n):
        y, x = int(ys[i]), int(xs[i])
        canvas[i, :, y : y + DIGIT_SIZE, x : x + DIGIT_SIZE] = big[i, 0].clamp(0, 1) * tint[i]
    return canvas


def rendered_split(split: str, copies: int = 1, seed: int = 0):
    """(images [N*copies, 3, 32, 32] in [0, 1], labels [N*copies, 2] (digit, colour), prompts), fixed by
    `seed`; each digit's colour is drawn uniformly."""
    digits, digit = load_digits(split)
    g = torch.Generator().manual_seed(seed)
    digits, digit = digits.repeat(copies, 1, 1), digit.repeat(copies)
    colour = torch.randint(len(COLOURS), (len(digit),), generator=g)
    images = render(digits, colour, g)
    prompts = [Attributes(int(d), int(c)).prompt for d, c in zip(digit, colour)]
    return images, torch.stack([digit, colour], 1), prompts
