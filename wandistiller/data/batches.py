"""Per-step training batches: a pure function of (seed, step, micro-batch, rank), so any process -- a resumed
run, or a teacher owner building every rank's batch -- can rebuild them exactly.

`BatchSettings` holds what every batch of a run is drawn with; `batch_source(settings)` is the
`(step, micro, dp_rank) -> Batch` a training rank and a teacher owner both call.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from wandistiller.data.prompts import PromptEmbeddings, to_device
from wandistiller.teacher.image import ImageCondition

if TYPE_CHECKING:  # latents.py draws batches' x0 through the teacher: its type only
    from wandistiller.data.conditions import ImageBank
    from wandistiller.data.latents import LatentBank


@dataclass
class Batch:
    prompt_idx: torch.Tensor  # [B]
    x_t: torch.Tensor  # [B, C, F, H, W] noisy latents
    t: torch.Tensor  # [B] float timesteps in [0, num_train_timesteps)
    cond: torch.Tensor  # [B, L, D]
    uncond: torch.Tensor  # [B, L, D]
    # What x_t was mixed from, for losses that need it (wandistiller.recipe.losses: "x0"); None: not kept.
    x0: torch.Tensor | None = None
    noise: torch.Tensor | None = None
    # An image-to-video teacher's conditioning (teacher/image.py), which the student takes too; None: text alone.
    image: ImageCondition | None = None

    def to(self, device: torch.device) -> Batch:
        moved: dict[str, Any] = {k: v if v is None else v.to(device, non_blocking=True) for k, v in vars(self).items()}
        return Batch(**moved)


@dataclass(frozen=True)
class BatchSettings:
    """What every batch of one run is drawn with: all but where in the run it is (step, micro-batch, rank).

    `latent_bank` (teacher samples or encoded images) gives x0, None:
    Gaussian x0. `images` gives each drawn prompt its image (an image-to-video teacher's conditioning).
    With `device` the batches are built there (the same values as on the CPU); None: on the CPU.
    `keep_x0`: the batches carry x0 and the noise too (a loss that needs them: wandistiller.recipe.losses).
    """

    seed: int
    batch_size: int
    latent_shape: tuple[int, int, int, int]
    flow_shift: float
    num_train_timesteps: int
    embeddings: PromptEmbeddings
    latent_bank: LatentBank | None = None
    device: torch.device | None = None
    keep_x0: bool = False
    # An image-to-video teacher's conditioning per prompt; Gaussian x0 then draws from its prompts alone.
    images: ImageBank | None = None


def shifted_sigmas(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Wan's flow shift applied to uniform u in [0, 1): sigma = s*u / (1 + (s-1)*u)."""
    return shift * u / (1 + (shift - 1) * u)


def make_batch(settings: BatchSettings, step: int, micro: int, rank: int) -> Batch:
    """One micro-batch, a pure function of its arguments, on `settings.device` (None: the CPU).

    x0 is Gaussian, or drawn from the latent bank with the same generator; the prompt is then the latent's
    own, so cond matches x0. The random draws are made on the CPU whatever the device, so every device agrees
    bit for bit; on a GPU only they (through pinned memory) and the prompts' own tokens move, and the padding
    is done there.
    """
    s, n, device = settings, settings.batch_size, settings.device
    g = torch.Generator().manual_seed(mixed_seed(s.seed, step, micro, rank))
    if s.latent_bank is None:
        # A folder's held-out captions follow its training ones in the embeddings: only those with an image draw.
        prompts = len(s.embeddings.embeds) if s.images is None else len(s.images)
        prompt_idx = torch.randint(prompts, (n,), generator=g)
        x0 = torch.randn((n, *s.latent_shape), generator=g)
    else:
        prompt_idx, x0 = s.latent_bank.draw(n, g)
    noise = torch.randn((n, *s.latent_shape), generator=g)
    sigma = shifted_sigmas(torch.rand(n, generator=g), s.flow_shift)
    mix = sigma.view(-1, 1, 1, 1, 1)
    x_t = (1 - mix) * x0 + mix * noise  # rectified flow: the velocity is noise - x0
    moved = (lambda x: x) if device is None else (lambda x: to_device(x, device))
    return Batch(
        prompt_idx=moved(prompt_idx),
        x_t=moved(x_t),
        t=moved(sigma * s.num_train_timesteps),
        cond=s.embeddings.padded(prompt_idx, device),
        uncond=s.embeddings.negative_batch(n, device),
        x0=moved(x0) if s.keep_x0 else None,
        noise=moved(noise) if s.keep_x0 else None,
        image=None if s.images is None else s.images.select(prompt_idx).to(device or torch.device("cpu")),
    )


def batch_source(settings: BatchSettings) -> Callable[[int, int, int], Batch]:
    """`(step, micro, dp_rank) -> Batch` for one run: what a training rank and a teacher owner both call."""
    bank = settings.latent_bank
    if bank is not None and bank.latent_shape != tuple(settings.latent_shape):
        raise ValueError(f"latent bank holds {bank.latent_shape} latents, the run trains on {settings.latent_shape}")
    return functools.partial(make_batch, settings)


def mixed_seed(*ints: int) -> int:
    """A generator seed from several integers (seed, step, micro-batch, rank), each of them changing it."""
    return int.from_bytes(hashlib.blake2b(repr(ints).encode(), digest_size=8).digest(), "little") >> 1
