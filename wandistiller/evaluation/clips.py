"""Quality of clips (a run with `data.latent_frames > 1`), the way metrics.py judges images. Clips are
[N, F, 3, H, W] floats in [0, 1] throughout.

- Pocket video prompts ("a red 3 moving left"): the frame judge (pocket/video.py's, shipped beside the video teacher)
  reads digit and colour off every frame, and the pixels give the motion (pocket/clips.py: the digit's centroid
  track, fitted by a line):
    frame_accuracy          share of frames whose digit and colour are both as asked (over every frame of every clip)
    motion_accuracy         share of clips whose fitted track goes the asked way (or stands still, as asked)
    speed                   mean px per frame along the fitted tracks; `motion_ratio` is the student's over the
                            teacher's, from the same noises (the stand-in for VBench's dynamic degree, continuous)
    temporal_consistency    share of clips whose judged digit and colour are the same on every frame
    clip_fd                 Fréchet distance of the clips' features (below) to the held-out digits' rendered clips;
                            withheld from fewer than `MIN_FD_CLIPS` clips (a covariance of rank < its width)
    diversity               intra-prompt diversity (metrics.py's) of the clips' features
  A clip's features (`CLIP_FEATURES` wide): the judge's 64-wide per-frame features averaged over time, and the mean
  absolute change of them from frame to frame (what moves), each pooled to 32 so that 40 prompts x 2 noises are
  enough for a Fréchet distance.
- Any clips (a real Wan teacher's prompts too): `frame_motion`, the mean absolute pixel change from one frame to the
  next (no model needed; its `motion_ratio` where the pocket's speed is not there), and with `--clip-model` the
  per-frame CLIP score (torchmetrics and a CLIP model, named in one line where it cannot be had).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from wandistiller.core.errors import UserError
from wandistiller.evaluation.metrics import clip_score, diversity_ratio, inception_fid, intra_prompt_diversity
from wandistiller.pocket import FRAME_CLASSIFIER_FILE
from wandistiller.pocket.classifier import load_classifier
from wandistiller.pocket.clips import parse_video_prompt, read_motion, rendered_clip_split, speeds

if TYPE_CHECKING:
    from wandistiller.pocket.classifier import DigitJudge

CLIP_FEATURES = 64  # 32 of the time-mean features + 32 of their frame-to-frame change
MIN_FD_CLIPS = CLIP_FEATURES + 1  # fewer: the features' covariance is rank-deficient and the distance meaningless
FD_WITHHELD = (
    f"clip_fd needs {MIN_FD_CLIPS} clips or more (the clip features are {CLIP_FEATURES} wide): raise --limit or "
    "--per-prompt"
)


def first_frame_psnr(clips: torch.Tensor, given: torch.Tensor) -> list[float]:
    """Per clip of [N, F, 3, H, W], the PSNR (dB) of its frame 0 against its given first frame [N, 3, H, W]: how
    well an image-to-video sample keeps the image it continues. Pixels in [0, 1], quantised to 8 bits as saved."""
    quantised = lambda x: (x.float().clamp(0, 1) * 255).round() / 255
    mse = ((quantised(clips[:, 0]) - quantised(given)) ** 2).flatten(1).mean(1).clamp_min(1e-10)
    return (-10 * torch.log10(mse)).tolist()


def pil_tensor(image) -> torch.Tensor:
    """A PIL image as [3, H, W] in [0, 1] (what decoded frames are)."""
    return torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255).permute(2, 0, 1)


def is_video_pocket(prompts: list[str]) -> bool:
    """Every prompt is a pocket video prompt: the frame judge and the motion read can judge them."""
    return bool(prompts) and all(parse_video_prompt(p) is not None for p in prompts)


def load_frame_judge(path: Path = FRAME_CLASSIFIER_FILE) -> DigitJudge:
    """The video teacher's frame judge (one line where it is not built)."""
    if not Path(path).is_file():
        raise UserError(
            f"{path}: the pocket video teacher's frame judge is missing; build it with "
            "python -m wandistiller.pocket.build --only video"
        )
    return load_classifier(path)


@torch.no_grad()
def frame_features(judge: DigitJudge, clips: torch.Tensor, batch: int = 512) -> torch.Tensor:
    """[N, F, 3, H, W] -> the judge's per-frame features [N, F, 64]."""
    frames = clips.flatten(0, 1).float()
    rows = [judge(frames[i : i + batch]) for i in range(0, len(frames), batch)]
    return torch.cat(rows).view(*clips.shape[:2], -1)


def clip_features(per_frame: torch.Tensor) -> torch.Tensor:
    """[N, F, D] per-frame features -> [N, CLIP_FEATURES]: the time mean and the mean frame-to-frame change, each
    pooled to half of CLIP_FEATURES."""
    mean = per_frame.mean(1)
    change = (per_frame[:, 1:] - per_frame[:, :-1]).abs().mean(1) if per_frame.shape[1] > 1 else torch.zeros_like(mean)
    half = CLIP_FEATURES // 2
    return torch.cat([F.adaptive_avg_pool1d(x[:, None].float(), half)[:, 0] for x in (mean, change)], 1)


def frechet_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """The Fréchet distance between two feature sets [N, D] and [M, D] (Gaussian fits; torchmetrics' FID formula)."""
    from torchmetrics.image.fid import _compute_fid

    a, b = a.double(), b.double()
    return float(_compute_fid(a.mean(0), torch.cov(a.T), b.mean(0), torch.cov(b.T)))


@functools.lru_cache(maxsize=1)
def heldout_clip_reference() -> torch.Tensor:
    """The held-out real digits rendered as clips (fixed colours, motions and places): what clip_fd compares with
    (rendered once a process)."""
    return rendered_clip_split("heldout", copies=1, seed=7)[0]


def frame_motion(clips: torch.Tensor) -> torch.Tensor:
    """[N] the mean absolute pixel change from one frame to the next (0 for a still clip, 0-1 scale)."""
    if clips.shape[1] < 2:
        return torch.zeros(len(clips))
    return (clips[:, 1:].float() - clips[:, :-1].float()).abs().flatten(1).mean(1)


def pocket_clip_scores(
    clips: torch.Tensor, prompts: list[str], judge: DigitJudge, reference_features: torch.Tensor | None = None
) -> dict[str, float]:
    """The pocket video figures (the module's docstring) of clips made for pocket video prompts."""
    wanted = torch.tensor([a.labels for a in map(parse_video_prompt, prompts) if a is not None])
    assert len(wanted) == len(clips), "every prompt a pocket video prompt (is_video_pocket)"
    per_frame = frame_features(judge, clips)  # one pass of the judge: its heads read these features
    with torch.no_grad():
        judged = torch.stack([judge.digit(per_frame).argmax(-1), judge.colour(per_frame).argmax(-1)], -1)
    right = judged == wanted[:, None, :2]
    features = clip_features(per_frame)
    scores = {
        "frame_accuracy": float(right.all(-1).float().mean()),
        "digit_frame_accuracy": float(right[..., 0].float().mean()),
        "colour_frame_accuracy": float(right[..., 1].float().mean()),
        "motion_accuracy": float((read_motion(clips) == wanted[:, 2]).float().mean()),
        "temporal_consistency": float((judged == judged[:, :1]).all(-1).all(-1).float().mean()),
        "speed": float(speeds(clips).mean()),
        "samples": len(clips),
    }
    diversity = intra_prompt_diversity(features, prompts)
    scores |= {} if diversity is None else {"diversity": diversity}
    if reference_features is not None and min(len(features), len(reference_features)) >= MIN_FD_CLIPS:
        scores["clip_fd"] = frechet_distance(reference_features, features)
    return scores


def motion_ratio(scores: dict) -> dict[str, float]:
    """{"motion_ratio": the student's speed / the teacher's} (the pocket's centroid speed, else the frame-difference
    motion), where `scores` hold both and the teacher's is above 0; else {}."""
    for key in ("speed", "frame_motion"):
        student, teacher = scores.get(f"student_{key}"), scores.get(f"teacher_{key}")
        if student is not None and teacher is not None:
            return {"motion_ratio": student / teacher} if teacher > 0 else {}
    return {}


def eval_clip_quality(
    prompts: list[str], clips: dict[str, torch.Tensor], clip_model: str | None = None, fid_reference: str | None = None
) -> dict[str, float]:
    """`eval`'s quality columns for each of {"teacher": clips, "student": clips}: `<who>_<figure>` (the module's
    docstring; with `fid_reference`, the Inception FID of every frame), `diversity_ratio` and `motion_ratio` where
    both are given."""
    pocket = is_video_pocket(prompts)
    judge = load_frame_judge() if pocket else None
    reference = clip_features(frame_features(judge, heldout_clip_reference())) if judge is not None else None
    out: dict[str, float] = {}
    for who, these in clips.items():
        if judge is not None:
            out |= {f"{who}_{k}": v for k, v in pocket_clip_scores(these, prompts, judge, reference).items()}
        out[f"{who}_frame_motion"] = float(frame_motion(these).mean())
        if clip_model is not None:  # per frame: every frame against its clip's prompt
            per_frame = [p for p in prompts for _ in range(these.shape[1])]
            out[f"{who}_clip_score"] = clip_score(these.flatten(0, 1), per_frame, clip_model)
        if fid_reference is not None:
            out[f"{who}_inception_fid"] = inception_fid(these.flatten(0, 1), fid_reference)
    return out | diversity_ratio(out) | motion_ratio(out)
