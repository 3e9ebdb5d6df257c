"""The figures of the collapse watch (recipe/hooks/collapse.py) and their judgement: intra-prompt diversity, the share
of clipped and of flat images, a clip's motion, each student figure against the teacher's, and the warning signs."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from wandistiller.core.errors import UserError
from wandistiller.evaluation.clips import frame_motion, is_video_pocket
from wandistiller.evaluation.metrics import intra_prompt_diversity, judge_features
from wandistiller.pocket.clips import speeds

if TYPE_CHECKING:
    pass


# An image whose pixels' standard deviation is under this (about 5 of 255 levels) is near-constant: a solid colour.
FLAT_STD = 0.02


# Pixel features (prompts the pocket judge cannot read): each image pooled to at most this side, so the distance
# weighs the layout and colours a collapse loses, not pixel noise, and a large frame stays cheap.
POOLED_SIDE = 32


def motion(clips: torch.Tensor, prompts: list[str]) -> float:
    """A probe set's motion: the pocket digit's mean speed (px per frame) on pocket video prompts, else the mean
    absolute pixel change from frame to frame."""
    return float((speeds(clips) if is_video_pocket(prompts) else frame_motion(clips)).mean())


def figures(samples: torch.Tensor, prompts: list[str], judge=None) -> dict[str, float]:
    """`image_figures` of images [N, 3, H, W]; of clips [N, F, 3, H, W], those of their first frames and `motion`."""
    if samples.dim() == 4:
        return image_figures(samples, prompts, judge)
    return image_figures(samples[:, 0], prompts, judge) | {"motion": motion(samples, prompts)}


def clipped_share(images: torch.Tensor) -> float:
    """The share of pixel values at 0 or 255 once quantized (what a saturated, blown-out or black image is)."""
    levels = (images.float() * 255).round()
    return float(((levels <= 0) | (levels >= 255)).float().mean())


def flat_share(images: torch.Tensor) -> float:
    """The share of near-constant images (their pixels' standard deviation under FLAT_STD)."""
    return float((images.float().flatten(1).std(1) < FLAT_STD).float().mean())


def pixel_features(images: torch.Tensor) -> torch.Tensor:
    """[N, D] pooled pixels: the features diversity is measured on where no judge reads the prompts."""
    side = min(POOLED_SIDE, images.shape[-2], images.shape[-1])
    return torch.nn.functional.adaptive_avg_pool2d(images.float(), side).flatten(1)


def image_figures(images: torch.Tensor, prompts: list[str], judge=None) -> dict[str, float]:
    """`diversity` (intra-prompt, evaluation/metrics.py's, on the `judge`'s features when given, else pixels),
    `saturation` (clipped share) and `flat` (near-constant share) of decoded images [N, 3, H, W] in [0, 1]."""

    features = judge_features(judge, images) if judge is not None else pixel_features(images)
    diversity = intra_prompt_diversity(features, prompts)
    figures = {"saturation": clipped_share(images), "flat": flat_share(images)}
    return figures | ({"diversity": diversity} if diversity is not None else {})


def compared(student: dict, teacher: dict | None) -> dict[str, float]:
    """The logged figures (`collapse/...`): the student's, the teacher's beside them, and the diversity ratio."""
    out = {f"collapse/{k}": v for k, v in student.items()}
    if teacher is None:
        return out
    out |= {f"collapse/teacher_{k}": v for k, v in teacher.items()}
    if student.get("diversity") is not None and teacher.get("diversity"):
        out["collapse/diversity_ratio"] = student["diversity"] / teacher["diversity"]
    if student.get("motion") is not None and teacher.get("motion"):
        out["collapse/motion_ratio"] = student["motion"] / teacher["motion"]
    return out


def collapse_signs(metrics: dict, min_diversity: float, max_rise: float) -> list[str]:
    """What in the logged figures looks collapsed ([] where nothing does, or without the teacher's)."""
    signs = []
    ratio = metrics.get("collapse/diversity_ratio")
    if ratio is not None and ratio < min_diversity:
        signs.append(f"diversity {ratio:.2f}x the teacher's (under hooks.collapse.min_diversity={min_diversity:g})")
    for key, what in (("saturation", "clipped pixels"), ("flat", "near-constant images")):
        mine, theirs = metrics.get(f"collapse/{key}"), metrics.get(f"collapse/teacher_{key}")
        if mine is not None and theirs is not None and mine - theirs > max_rise:
            signs.append(f"{mine:.0%} {what} against the teacher's {theirs:.0%}")
    return signs


def motion_sign(metrics: dict, min_motion: float) -> str | None:
    """The motion lost, in words, where the logged motion ratio is under `min_motion`; else None."""
    ratio = metrics.get("collapse/motion_ratio")
    if ratio is None or ratio >= min_motion:
        return None
    return f"motion {ratio:.2f}x the teacher's (under hooks.collapse.min_motion={min_motion:g})"


def summary(metrics: dict) -> str:
    """The figures of one check, as train.log shows them."""

    def beside(key: str, fmt: str) -> str:
        teacher = metrics.get(f"collapse/teacher_{key}")
        return "" if teacher is None else f" (the teacher's {teacher:{fmt}})"

    ratio, mine = metrics.get("collapse/diversity_ratio"), metrics.get("collapse/diversity")
    if ratio is not None:
        diversity = f"diversity {ratio:.2f}x the teacher's"
    else:
        diversity = "diversity withheld" if mine is None else f"diversity {mine:.3g}"
    saturation = f"clipped pixels {metrics['collapse/saturation']:.1%}{beside('saturation', '.1%')}"
    moving = (
        ""
        if "collapse/motion_ratio" not in metrics
        else f", motion {metrics['collapse/motion_ratio']:.2f}x the teacher's"
    )
    return f"{diversity}, {saturation}, flat images {metrics['collapse/flat']:.0%}{beside('flat', '.0%')}{moving}"


def checked_share(key: str, value: float) -> float:
    if not (math.isfinite(value) and 0 <= value <= 1):
        raise UserError(f"{key}={value} must be a share between 0 and 1")
    return value
