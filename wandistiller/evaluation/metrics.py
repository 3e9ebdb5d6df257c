"""Quality the way the field measures it: prompt adherence and distance to real images.

- Pocket teacher (offline, the default here): the shipped judge classifier reads digit and colour off
  each image; prompt accuracy is the fraction with both as asked (the stand-in for CLIP
  score). FID and KID (torchmetrics) compare the judge's 64-wide features of the samples with those of the
  held-out real digits (the stand-in for Inception features): no download, no torch-fidelity.
- A real Wan teacher: CLIP score (torchmetrics, a CLIP model id or folder) and Inception FID against a
  folder of reference images. Where the weights cannot be had, one line names the option.
- Intra-prompt diversity (pocket prompts, several images per prompt): the mean pairwise distance of the judge's
  features among one prompt's images, averaged over prompts; a few-step student that collapses its noises onto one
  image scores low beside its teacher whatever its accuracy.
Images are [N, 3, H, W] floats in [0, 1] throughout.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image
from torch import nn

from wandistiller.core.errors import UserError
from wandistiller.pocket.classifier import load_classifier
from wandistiller.pocket.digits import ATTRIBUTE_NAMES, parse_prompt, rendered_split

if TYPE_CHECKING:
    from wandistiller.pocket.classifier import DigitJudge

KID_SUBSET = 50  # KID's subset size: at most the smaller image count (torchmetrics' default 1000 is for 50k)
# What a KID figure here is, said wherever one shows (eval's output and json, the quality report): the field quotes
# Inception KIDs x1000 (raw ~0.001-0.05); the judge's features are not Inception's and give raw 10^2-10^4, which
# scaling would only inflate.
KID_MEANING = (
    "kid: KID (torchmetrics: the unbiased MMD^2 under the cubic kernel (x.y/64 + 1)^3) of the pocket judge's 64-wide "
    "features, unscaled, in the judge's own units (~10^3; not x1000, not Inception's): compare it only with "
    "other pocket KIDs"
)


def prompt_accuracy(predicted: torch.Tensor, wanted: torch.Tensor) -> dict[str, float]:
    """[N, K] predicted and wanted attributes -> the fraction with all K right ("prompt_accuracy") and each."""

    right = predicted == wanted
    names = ATTRIBUTE_NAMES[: wanted.shape[1]]
    return {"prompt_accuracy": float(right.all(1).float().mean())} | {
        f"{name}_accuracy": float(right[:, k].float().mean()) for k, name in enumerate(names)
    }


def min_fid_samples(feature: nn.Module) -> int:
    """The fewest images FID/KID mean something from: more than the features are wide, or the covariance is
    rank-deficient (8 images of the judge's 64 features gave FID ~1300 beside 170, and KID -3605)."""
    return int(getattr(feature, "num_features", 64)) + 1


def fid_kid(real: torch.Tensor, fake: torch.Tensor, feature: nn.Module) -> dict[str, float]:
    """FID and KID (mean) between two image sets through `feature` (an nn.Module returning [N, D]); {} (withheld)
    from fewer than `min_fid_samples` images. KID's subsets are as large as the smaller set allows, up to 50."""
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.image.kid import KernelInceptionDistance

    if min(len(real), len(fake)) < min_fid_samples(feature):
        return {}
    subset = min(KID_SUBSET, len(real), len(fake))
    fid = FrechetInceptionDistance(feature=feature, normalize=True)
    with warnings.catch_warnings():
        # torchmetrics warns at every KID it builds that the metric keeps every feature it is given (printed by
        # every pocket eval); here that is eval's images x 64 floats (80 images: 20 KB), nothing to warn of
        warnings.filterwarnings(
            "ignore",
            message="Metric `Kernel Inception Distance` will save all extracted features",
            category=UserWarning,
        )
        kid = KernelInceptionDistance(feature=feature, normalize=True, subset_size=subset)
    for metric in (fid, kid):
        metric.update(real.float(), real=True)
        metric.update(fake.float(), real=False)
    torch.manual_seed(0)  # KID draws its subsets at random: the same draws every call
    return {"fid": float(fid.compute()), "kid": float(kid.compute()[0])}


def intra_prompt_diversity(features: torch.Tensor, prompts: list[str]) -> float | None:
    """The mean over prompts with 2 or more images of the mean pairwise (L2) distance of their images' features
    [N, D] (one row per image of `prompts`, in any order); None (withheld) where no prompt has two images."""
    groups: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(i)
    spreads = [float(torch.pdist(features[rows].double()).mean()) for rows in groups.values() if len(rows) >= 2]
    return sum(spreads) / len(spreads) if spreads else None


@torch.no_grad()
def judge_features(judge: nn.Module, images: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """The judge's feature vectors [N, D] of `images` (what FID/KID compare), in batches."""
    return torch.cat([judge(images[i : i + batch].float()) for i in range(0, len(images), batch)])


def heldout_reference(copies: int = 1) -> torch.Tensor:
    """The held-out real digits, rendered with fixed colours and places: what FID/KID compare against."""

    return rendered_split("heldout", copies=copies, seed=7)[0]


def pocket_scores(images: torch.Tensor, prompts: list[str], judge: DigitJudge | None = None, reference=None) -> dict:
    """Prompt accuracy, FID/KID to the held-out digits, and intra-prompt `diversity` (where a prompt has several
    images) of images made for pocket prompts; {} when a prompt is not one (another teacher's run)."""

    wanted = [parse_prompt(p) for p in prompts]
    if not prompts or any(w is None for w in wanted):
        return {}
    judge = judge or load_classifier()
    wanted_t = torch.tensor([w.labels for w in wanted if w is not None])  # none is, as checked above
    scores = prompt_accuracy(judge.predict(images.float()), wanted_t) | {"samples": len(images)}
    diversity = intra_prompt_diversity(judge_features(judge, images), prompts)
    scores |= {} if diversity is None else {"diversity": diversity}  # withheld: one image per prompt
    reference = heldout_reference() if reference is None else reference
    return scores | fid_kid(reference, images, judge)  # no fid/kid from too few samples


# What PIL raises on a file that is not an image, is truncated, is a folder, or is too large to decode.
UNREADABLE = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def _unreadable(key: str, file: Path, error: Exception) -> UserError:
    return UserError(f"{key}: {file.name} is not an image PIL can read ({type(error).__name__}); remove it")


def check_real_metrics(clip_model: str | None, fid_reference: str | None) -> None:
    """The real-Wan options' models and files had now, each failure one line, before anything samples (they were
    found wanting after the teacher's and the student's samples)."""
    if clip_model is not None:
        _clip_model(clip_model)
    if fid_reference is not None:  # each image opened, none decoded: the metric reads them once, after the samples
        key = f"--fid-reference={fid_reference!r}"
        for file in _reference_files(Path(fid_reference).expanduser(), key):
            try:
                with Image.open(file) as image:
                    image.verify()
            except UNREADABLE as e:
                raise _unreadable(key, file, e) from None
        _fid_metric(fid_reference, with_reference=False)


def clip_score(images: torch.Tensor, prompts: list[str], model: str, chunk: int = 64) -> float:
    """CLIP score (0-100) with `model` (a Hub id or a local folder) as torchmetrics' CLIPScore computes it: 100 x the
    cosine of each image's CLIP embedding with its prompt's, averaged, then floored at 0. Its CLIPScore reads
    embeddings as transformers 4 returned them and fails on transformers 5's outputs, so the score is computed here.
    Prompts are cut to the text encoder's positions (77), as its tokenizer's own limit may be unset."""
    clip, processor = _clip_model(model)
    pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    longest = clip.config.text_config.max_position_embeddings
    scores = []
    with torch.inference_mode():
        for start in range(0, len(prompts), chunk):
            inputs = processor(text=prompts[start : start + chunk], images=list(pixels[start : start + chunk]),
                               return_tensors="pt", padding=True, truncation=True, max_length=longest)  # fmt: skip
            out = clip(**inputs)  # image_embeds and text_embeds: projected and unit-normalised
            scores.append(100 * (out.image_embeds * out.text_embeds).sum(-1))
    return max(float(torch.cat(scores).mean()), 0.0)


# Loaded once, at the check before sampling, then used for the teacher's and the student's images (it was loaded
# three times).
@functools.lru_cache(maxsize=1)
def _clip_model(model: str):
    from transformers import CLIPModel, CLIPProcessor

    try:
        return CLIPModel.from_pretrained(model).eval(), CLIPProcessor.from_pretrained(model)
    except Exception as e:  # offline, unknown id, a folder that is not CLIP: all "cannot have it"
        raise UserError(
            f"--clip-model={model!r} cannot be loaded ({type(e).__name__}); give a local CLIP folder "
            "(hf download openai/clip-vit-base-patch16 --local-dir DIR) or leave --clip-model out"
        ) from None


def inception_fid(images: torch.Tensor, reference_dir: str) -> float:
    """FID with the standard Inception-v3 features against the images of a folder (torch-fidelity weights)."""
    fid = _fid_metric(reference_dir)
    fid.update(images.float().clamp(0, 1), real=False)
    return float(fid.compute())


def _fid_metric(reference_dir: str, with_reference: bool = True):
    """torchmetrics' FID, the folder's images given as the real ones (`with_reference`)."""
    from torchmetrics.utilities.imports import _TORCH_FIDELITY_AVAILABLE

    key = f"--fid-reference={reference_dir!r}"
    reference = _folder_images(Path(reference_dir).expanduser(), key) if with_reference else None
    if not _TORCH_FIDELITY_AVAILABLE:
        raise UserError(
            f"{key}: Inception FID needs torch-fidelity (pip install torch-fidelity, online once for "
            "its weights); or leave --fid-reference out"
        )
    from torchmetrics.image.fid import FrechetInceptionDistance

    try:
        fid = FrechetInceptionDistance(feature=2048, normalize=True)
    except Exception as e:  # the Inception weights could not be downloaded
        raise UserError(
            f"{key}: the Inception weights cannot be had ({type(e).__name__}); run once online "
            "or leave --fid-reference out"
        ) from None
    if reference is not None:
        fid.update(reference, real=True)
    return fid


def _reference_files(folder: Path, key: str) -> list[Path]:
    files = sorted(p for p in folder.glob("*") if p.suffix.lower() in {".png", ".jpg", ".jpeg", ".webp"})
    if not folder.is_dir() or len(files) < 2:
        raise UserError(f"{key} holds fewer than 2 images (.png/.jpg/.webp); give a folder of reference images")
    return files


def _folder_images(folder: Path, key: str, size: int = 299) -> torch.Tensor:
    rows = []
    for file in _reference_files(folder, key):
        try:
            with Image.open(file) as image:
                rows.append(np.asarray(image.convert("RGB").resize((size, size)), dtype=np.float32) / 255)
        except UNREADABLE as e:
            raise _unreadable(key, file, e) from None
    return torch.from_numpy(np.stack(rows)).permute(0, 3, 1, 2)


def eval_quality(
    prompts: list[str], images: dict[str, torch.Tensor], clip_model: str | None = None, fid_reference: str | None = None
) -> dict[str, float]:
    """`eval`'s quality columns for each of {"teacher": images, "student": images}: `<who>_prompt_accuracy`,
    `<who>_fid`, `<who>_kid`, `<who>_diversity` where the prompts are the pocket's (diversity where a prompt has
    several images; `diversity_ratio`, student / teacher, where both are given), and the real-Wan options when
    asked."""

    pocket = bool(prompts) and all(parse_prompt(p) is not None for p in prompts)
    judge, reference = (load_classifier(), heldout_reference()) if pocket else (None, None)
    out: dict[str, float] = {}
    for who, imgs in images.items():
        if pocket:
            scores = pocket_scores(imgs, prompts, judge, reference)
            keys = ("prompt_accuracy", "samples", "fid", "kid", "diversity")
            out |= {f"{who}_{k}": scores[k] for k in keys if k in scores}
        if clip_model is not None:
            out[f"{who}_clip_score"] = clip_score(imgs, prompts, clip_model)
        if fid_reference is not None:
            out[f"{who}_inception_fid"] = inception_fid(imgs, fid_reference)
    return out | diversity_ratio(out)


def diversity_ratio(scores: dict) -> dict[str, float]:
    """{"diversity_ratio": student / teacher} where `scores` hold both diversities (the teacher's above 0), else {}."""
    student, teacher = scores.get("student_diversity"), scores.get("teacher_diversity")
    return {"diversity_ratio": student / teacher} if student is not None and teacher else {}
