"""The pocket judge: a small CNN that reads digit and colour off a 32x32 image.

Trained on the same rendered digits as the teacher (train split only), in seconds, and shipped beside it.
Two uses: prompt accuracy (both attributes right: the offline stand-in for CLIP score) and, through
its 64-wide penultimate layer, the features FID/KID compare (the stand-in for Inception's).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from wandistiller.pocket.digits import COLOURS, rendered_split

log = logging.getLogger(__name__)
CLASSIFIER_FILE = Path(__file__).resolve().parents[1] / "assets" / "pocket" / "classifier.safetensors"
FEATURES = 64


class DigitJudge(nn.Module):
    """[N, 3, 32, 32] images in [0, 1] -> features [N, 64]; `heads` -> digit and colour logits."""

    num_features = FEATURES  # what torchmetrics' FID/KID read to size their state

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Dropout(0.3),
            nn.Linear(32 * 4 * 4, FEATURES),
            nn.ReLU(),
        )
        self.digit, self.colour = nn.Linear(FEATURES, 10), nn.Linear(FEATURES, len(COLOURS))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype == torch.uint8:  # torchmetrics hands uint8 images when normalize=False
            images = images.float() / 255
        if images.shape[-1] != 32:
            images = F.interpolate(images.float(), size=(32, 32), mode="bilinear", antialias=True)
        return self.body(images.float())

    def heads(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self(images)
        return self.digit(h), self.colour(h)

    @torch.no_grad()
    def predict(self, images: torch.Tensor, batch: int = 256) -> torch.Tensor:
        """[N, 2] predicted (digit, colour), as `Attributes.labels`."""
        rows = []
        for i in range(0, len(images), batch):
            rows.append(torch.stack([h.argmax(1) for h in self.heads(images[i : i + batch])], 1))
        return torch.cat(rows)


def train_classifier(steps: int = 2000, batch: int = 128, seed: int = 0) -> DigitJudge:
    """Fit the judge on rendered train digits (8 renderings each, dropout): about two minutes on one core."""
    torch.manual_seed(seed)
    images, labels, _ = rendered_split("train", copies=8, seed=seed + 100)
    return fit_judge(images, labels, steps, batch, seed)


def fit_judge(images: torch.Tensor, labels: torch.Tensor, steps: int, batch: int = 128, seed: int = 0) -> DigitJudge:
    """A DigitJudge fit on [N, 3, 32, 32] images and their [N, 2+] (digit, colour, ...) labels; returned frozen."""
    model = DigitJudge().train()
    opt = torch.optim.AdamW(model.parameters(), 2e-3, weight_decay=1e-2)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        idx = torch.randint(len(images), (batch,), generator=g)
        logits = model.heads(images[idx])
        loss = cast(torch.Tensor, sum(F.cross_entropy(lg, labels[idx, k]) for k, lg in enumerate(logits)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 200 == 0:
            log.info("classifier step %d loss %.4f", step + 1, float(loss))
    return model.eval()


def load_classifier(path: Path = CLASSIFIER_FILE) -> DigitJudge:
    """The shipped judge (weights only, safetensors)."""

    model = DigitJudge()
    model.load_state_dict(load_file(str(path)))
    return model.eval().requires_grad_(False)


def save_classifier(model: DigitJudge, path: Path = CLASSIFIER_FILE) -> None:

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
