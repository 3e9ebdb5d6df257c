"""The pocket video teacher's data: the same real digits, coloured, moving one way for a clip ("a red 3 moving left").

A clip is `FRAMES` frames of 32x32: a `CLIP_DIGIT` px digit on black, translated by `TRAVEL` px in total from
its first frame to its last, smoothly (sub-pixel, bilinear), in one of `MOTIONS` (or standing still). The digit
is smaller than the image teacher's 28 px so that it has room to move; it still covers about 3x3 of the
transformer's 2x2 tokens in each of the 5 latent frames (the pocket VAE compresses time 2x: 9 frames -> 5).
Every digit x colour x motion is a prompt (200); the prompts file is ordered so that its first 40 hold each
(digit, colour) once and each motion 8 times: `eval`'s `limit: 40` then judges a balanced set.

Motion is read back from the pixels, not by a network: the track of the digit's intensity centroid, fitted
by a straight line, gives a velocity (px per frame) whose direction is the motion and whose speed is what the
motion ratio compares (the stand-in for VBench's dynamic degree, kept continuous).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from wandistiller.pocket.digits import COLOURS, IMAGE_SIZE, load_digits

FRAMES = 9  # pixel frames; 5 latent frames through the pocket's 2x temporal VAE ((F - 1) / 2 + 1)
CLIP_DIGIT = 22
TRAVEL = float(IMAGE_SIZE - CLIP_DIGIT)  # px from the first frame to the last: edge to edge
# (dx, dy) in image coordinates (y grows downwards); the order is the judge's motion label.
MOTIONS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0), "still": (0.0, 0.0)}
# A clip whose fitted displacement (first to last frame) is under this many px reads as still: a third of
# TRAVEL, so a student at half the teacher's speed still reads as moving the right way (its speed shows in
# the motion ratio, not here).
STILL_BELOW = TRAVEL / 3


@dataclass(frozen=True)
class ClipAttributes:
    digit: int
    colour: int  # index into COLOURS
    motion: int  # index into MOTIONS

    @property
    def prompt(self) -> str:
        name = list(MOTIONS)[self.motion]
        how = "standing still" if name == "still" else f"moving {name}"
        return f"a {list(COLOURS)[self.colour]} {self.digit} {how}"

    @property
    def labels(self) -> tuple[int, int, int]:
        return self.digit, self.colour, self.motion


def all_clip_attributes() -> list[ClipAttributes]:
    """Every combination (200), in a fixed order."""
    return [
        ClipAttributes(d, c, m) for d, c, m in itertools.product(range(10), range(len(COLOURS)), range(len(MOTIONS)))
    ]


VIDEO_PROMPTS = [a.prompt for a in all_clip_attributes()]
BY_VIDEO_PROMPT = {a.prompt: a for a in all_clip_attributes()}


def parse_video_prompt(prompt: str) -> ClipAttributes | None:
    """The attributes a pocket video prompt asks for; None for any other text."""
    return BY_VIDEO_PROMPT.get(" ".join(prompt.lower().split()))


def video_prompt_file_order() -> list[str]:
    """The shipped prompts file's order: row k asks (digit, colour) number perm[k % 40] (a fixed shuffle) with
    motion (k // 40 + k) % 5. The first 40 rows (eval's `limit: 40`) hold every (digit, colour) once and every
    motion 8 times; all 200 rows hold every combination once; the last 10% (a run's validation prompts) mix too."""
    combos = list(itertools.product(range(10), range(len(COLOURS))))
    perm = torch.randperm(len(combos), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    for k in range(len(combos) * len(MOTIONS)):
        d, c = combos[perm[k % len(combos)]]
        rows.append(ClipAttributes(d, c, (k // len(combos) + k) % len(MOTIONS)).prompt)
    return rows


def render_clips(
    digits: torch.Tensor, colour: torch.Tensor, motion: torch.Tensor, g: torch.Generator, frames: int = FRAMES
) -> torch.Tensor:
    """[N, 8, 8] digits -> [N, frames, 3, 32, 32] clips in [0, 1]: upsampled to CLIP_DIGIT px, tinted, and moved
    TRAVEL px along their motion (from the side they leave), placed at random across it; still ones anywhere."""
    n = len(digits)
    big = F.interpolate(digits[:, None], size=(CLIP_DIGIT, CLIP_DIGIT), mode="bilinear", align_corners=False)
    tint = torch.tensor(list(COLOURS.values()))[colour].view(n, 3, 1, 1)
    sprite = big.clamp(0, 1) * tint  # [N, 3, d, d]
    pad = IMAGE_SIZE - CLIP_DIGIT
    canvas = F.pad(sprite, (0, pad, 0, pad))  # the digit at the top-left corner
    direction = torch.tensor(list(MOTIONS.values()))[motion]  # [N, 2]
    free = torch.rand(n, 2, generator=g) * TRAVEL  # a start anywhere the whole clip stays on the canvas
    start = torch.where(direction > 0, 0.0, torch.where(direction < 0, TRAVEL, free))
    t = torch.linspace(0, 1, frames)
    offset = start[:, None] + direction[:, None] * TRAVEL * t[None, :, None]  # [N, frames, 2] top-left in px
    # affine_grid samples the input at (output - shift): a shift of s px is -2s/size in normalised coordinates.
    theta = torch.zeros(n * frames, 2, 3)
    theta[:, 0, 0] = theta[:, 1, 1] = 1.0
    theta[:, :, 2] = -2 * offset.reshape(-1, 2) / IMAGE_SIZE
    grid = F.affine_grid(theta, [n * frames, 3, IMAGE_SIZE, IMAGE_SIZE], align_corners=False)
    src = canvas[:, None].expand(n, frames, 3, IMAGE_SIZE, IMAGE_SIZE).reshape(-1, 3, IMAGE_SIZE, IMAGE_SIZE)
    out = F.grid_sample(src, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out.view(n, frames, 3, IMAGE_SIZE, IMAGE_SIZE).clamp(0, 1)


def rendered_clip_split(split: str, copies: int = 1, seed: int = 0, frames: int = FRAMES):
    """(clips [N*copies, frames, 3, 32, 32], labels [N*copies, 3] (digit, colour, motion), prompts): each digit's
    colour and motion drawn uniformly, fixed by `seed`."""
    digits, digit = load_digits(split)
    g = torch.Generator().manual_seed(seed)
    digits, digit = digits.repeat(copies, 1, 1), digit.repeat(copies)
    colour = torch.randint(len(COLOURS), (len(digit),), generator=g)
    motion = torch.randint(len(MOTIONS), (len(digit),), generator=g)
    clips = render_clips(digits, colour, motion, g, frames)
    prompts = [ClipAttributes(int(d), int(c), int(m)).prompt for d, c, m in zip(digit, colour, motion)]
    return clips, torch.stack([digit, colour, motion], 1), prompts


def centroid_tracks(clips: torch.Tensor) -> torch.Tensor:
    """[N, F, 3, H, W] clips in [0, 1] -> [N, F, 2] (x, y) intensity centroids in px (the canvas centre where a
    frame is black). The background is black, so the centroid follows the digit."""
    n, f, _, h, w = clips.shape
    mass = clips.float().clamp(0, 1).sum(2)  # [N, F, H, W]
    total = mass.sum((2, 3))
    ys, xs = torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32)
    cx = (mass.sum(2) * xs).sum(-1) / total.clamp_min(1e-6)
    cy = (mass.sum(3) * ys).sum(-1) / total.clamp_min(1e-6)
    centre = torch.tensor([(w - 1) / 2, (h - 1) / 2])
    track = torch.stack([cx, cy], -1)
    return torch.where((total > 1e-3)[..., None], track, centre)


def velocities(clips: torch.Tensor) -> torch.Tensor:
    """[N, F, 3, H, W] -> [N, 2] least-squares slope of each centroid track, px per frame: the clip's motion,
    robust to a frame whose centroid jitters."""
    track = centroid_tracks(clips)
    f = track.shape[1]
    t = torch.arange(f, dtype=torch.float32) - (f - 1) / 2
    return (track * t[None, :, None]).sum(1) / (t * t).sum().clamp_min(1e-6)


def read_motion(clips: torch.Tensor) -> torch.Tensor:
    """[N] the motion label (index into MOTIONS) each clip shows: still below STILL_BELOW px of fitted travel,
    else the dominant axis's direction."""
    v = velocities(clips) * (clips.shape[1] - 1)  # fitted displacement, first frame to last
    dx, dy = v[:, 0], v[:, 1]
    horizontal = dx.abs() >= dy.abs()
    names = list(MOTIONS)
    label = torch.where(
        horizontal,
        torch.where(dx < 0, names.index("left"), names.index("right")),
        torch.where(dy < 0, names.index("up"), names.index("down")),
    )
    return torch.where(v.norm(dim=1) < STILL_BELOW, names.index("still"), label)


def speeds(clips: torch.Tensor) -> torch.Tensor:
    """[N] px per frame along each clip's fitted track: what the motion ratio averages."""
    return velocities(clips).norm(dim=1)
