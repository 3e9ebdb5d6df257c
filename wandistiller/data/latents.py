"""Clean latents sampled by the teacher itself, cached on disk: the x0 a student should learn on.

Gaussian x0 is not what the teacher meets when it samples, so at low and middle noise the student would
learn velocities on inputs the teacher never sees. Here diffusers' own WanPipeline runs the teacher's
experts (routed by boundary_ratio exactly as it routes them), its scheduler and guidance, from noise
drawn per (seed, prompt, k), and stops at `output_type="latent"`. No sampler of our own.

The cache is a folder of chunk files, each written atomically; a `complete.json` written last marks it
whole. An interrupted generation keeps its finished chunks and continues from the first missing one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from wandistiller.core.atomic import atomic_write, save_tensors
from wandistiller.core.tensor_files import file_stamps
from wandistiller.data.prompts import PromptEmbeddings
from wandistiller.teacher.finetune import stamp
from wandistiller.teacher.model import Teacher
from wandistiller.teacher.sampler import given_image, wan_pipeline
from wandistiller.teacher.spec import TeacherSpec

log = logging.getLogger(__name__)

COMPLETE = "complete.json"


@dataclass(frozen=True)
class SamplerSettings:
    """What the teacher samples with; every field is part of the cache key."""

    steps: int
    guidance_scales: tuple[float, ...]  # one per expert, as Teacher.guidance_scales
    latent_shape: tuple[int, int, int, int]  # C, F, H, W
    latents_per_prompt: int = 1


@dataclass
class LatentBank:
    """Clean latents and the prompt each came from; chunks are memory-mapped, so every rank can share one
    page cache instead of holding its own copy of a large bank."""

    chunks: list[torch.Tensor]  # [n, C, F, H, W] each; all but the last hold `chunk_size` rows
    prompt_idx: torch.Tensor  # [N] long
    chunk_size: int

    def __len__(self) -> int:
        return len(self.prompt_idx)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return tuple(self.chunks[0].shape[1:])

    def x0(self, items: torch.Tensor) -> torch.Tensor:
        rows = [self.chunks[j // self.chunk_size][j % self.chunk_size] for j in items.tolist()]
        return torch.stack(rows).float()

    def draw(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt indices, x0) for `n` latents chosen with `generator`: cond then matches each latent."""
        items = torch.randint(len(self), (n,), generator=generator)
        return self.prompt_idx[items], self.x0(items)


def noise_for(seed: int, prompt: int, k: int, shape: tuple[int, ...], stream: str = "teacher_latents") -> torch.Tensor:
    """The starting noise of latent k of a prompt: its own generator, so any chunking draws the same noise.
    `stream` keeps other users of the seed (evaluation, generation) off the training latents' noise."""
    digest = hashlib.blake2b(repr((stream, seed, prompt, k)).encode(), digest_size=8).digest()
    return torch.randn(shape, generator=torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1))


def _files_of(folder: Path) -> list:

    return file_stamps(folder, "*.safetensors")


def cache_key(spec: TeacherSpec, embeddings: PromptEmbeddings, seed: int, settings: SamplerSettings, dtype) -> str:
    """Teacher (configs, weight files, its LoRAs), prompts (and the negative one), seed, sampler, latent size, dtype."""
    experts = [[(spec.path / n / "config.json").read_text(), _files_of(spec.path / n)] for n in spec.experts]
    blob = json.dumps(
        [
            str(spec.path.resolve()),
            experts,
            (spec.path / "scheduler" / "scheduler_config.json").read_text(),
            spec.boundary_ratio,
            embeddings.prompts,
            # The negative prompt's text is not kept, its embedding is: hash that (one small tensor).
            hashlib.sha256(embeddings.negative.float().numpy().tobytes()).hexdigest(),
            embeddings.max_sequence_length,
            seed,
            [settings.steps, list(settings.guidance_scales), list(settings.latent_shape), settings.latents_per_prompt],
            str(dtype),
        ]
        # A fine-tuned teacher (teacher.lora): its files' content, strengths and experts; none, the key as before.
        + ([stamp(spec.loras)] if spec.loras else [])
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def teacher_pipeline(teacher: Teacher, scheduler=None):
    """WanPipeline around the loaded experts, on the teacher's device: no VAE (latents out); the teacher's own
    scheduler, or `scheduler` (a few-step student's)."""
    return wan_pipeline(teacher.spec, teacher.experts, teacher.device, scheduler=scheduler)


def sample_latents(pipe, noise, cond, uncond, settings: SamplerSettings, image=None, condition=None) -> torch.Tensor:
    """One WanPipeline call from the given noise; the clean latents, float32 on the CPU. An image-to-video pipeline
    (teacher/sampler.py `image_pipeline`) takes the first frame as `image` (a PIL image, which it encodes) or as
    `condition` (an ImageCondition of one image, encoded already: teacher/sampler.py `given_image`)."""
    _, frames, height, width = settings.latent_shape
    scales = settings.guidance_scales
    side = pipe.vae_scale_factor_spatial
    given = given_image(pipe, height * side, width * side, image, condition)
    out = pipe(
        **given,
        prompt_embeds=cond,
        negative_prompt_embeds=uncond,
        latents=noise,
        guidance_scale=scales[0],
        guidance_scale_2=scales[1] if len(scales) == 2 else None,
        num_inference_steps=settings.steps,
        height=height * pipe.vae_scale_factor_spatial,
        width=width * pipe.vae_scale_factor_spatial,
        num_frames=(frames - 1) * pipe.vae_scale_factor_temporal + 1,
        output_type="latent",
    ).frames
    return out.float().cpu()


def _chunk_path(folder: Path, c: int) -> Path:
    return folder / f"chunk_{c:06d}.pt"


def _generate_chunk(teacher: Teacher, pipe, embeddings, seed, settings, items: range) -> torch.Tensor:
    k_per = settings.latents_per_prompt
    prompts = torch.tensor([j // k_per for j in items])
    noise = torch.stack([noise_for(seed, j // k_per, j % k_per, settings.latent_shape) for j in items])
    dtype = teacher.dtype
    cond = embeddings.padded(prompts).to(teacher.device, dtype)
    uncond = embeddings.negative_batch(len(items)).contiguous().to(teacher.device, dtype)
    return sample_latents(pipe, noise.to(teacher.device), cond, uncond, settings)


def latents_folder(spec: TeacherSpec, embeddings, seed: int, settings: SamplerSettings, dtype, cache_dir) -> Path:
    """Where these latents are cached: what a rank without a teacher passes to `load_latent_bank`."""
    return Path(cache_dir).expanduser() / "teacher_latents" / cache_key(spec, embeddings, seed, settings, dtype)


def teacher_latents(
    teacher: Teacher,
    embeddings: PromptEmbeddings,
    seed: int,
    settings: SamplerSettings,
    cache_dir: str | os.PathLike,
    chunk_size: int = 16,
    progress: bool = True,
) -> LatentBank:
    """A LatentBank of `latents_per_prompt` teacher samples per prompt, generated once and cached.

    Item j is prompt j // K, sample j % K. Only the process holding the teacher calls this (an owner, or
    every rank of a sharded teacher together); the others, after a barrier, call
    `load_latent_bank(latents_folder(spec, embeddings, seed, settings, teacher_dtype, cache_dir))`.
    """
    folder = latents_folder(teacher.spec, embeddings, seed, settings, teacher.dtype, cache_dir)
    pipe: list = []  # built on the first chunk that needs it: a complete cache loads no pipeline

    def make_chunk(items: range) -> torch.Tensor:
        if not pipe:
            pipe.append(teacher_pipeline(teacher))
        return _generate_chunk(teacher, pipe[0], embeddings, seed, settings, items)

    total = len(embeddings.prompts) * settings.latents_per_prompt
    k = settings.latents_per_prompt
    return cached_bank(folder, total, chunk_size, k, make_chunk, "teacher latents", progress, settings.latent_shape)


def cached_bank(
    folder: Path,
    total: int,
    chunk_size: int,
    per_prompt: int,
    make_chunk,
    desc: str,
    progress: bool,
    item_shape: tuple[int, ...] | None = None,
):
    """Load the bank in `folder`, or make its missing chunks (each saved atomically) and then mark it whole.

    `make_chunk(items: range) -> [len(items), C, F, H, W]`. Good chunks already on disk are kept, so an
    interrupted run continues where it stopped; a damaged one (truncated, garbage, another shape, or
    deleted from a finished cache) is made again, said in one line.
    """
    bank = load_latent_bank(folder, item_shape)
    if bank is not None:
        log.info("%s: cached %s", desc, folder)
        return bank
    folder.mkdir(parents=True, exist_ok=True)
    starts = range(0, total, chunk_size)
    rows = [min(chunk_size, total - s) for s in starts]
    todo = [c for c in range(len(starts)) if _load_chunk(_chunk_path(folder, c), rows[c], item_shape) is None]
    damaged = [_chunk_path(folder, c).name for c in todo if _chunk_path(folder, c).exists()]
    if damaged or (folder / COMPLETE).exists():
        log.warning("%s: %s in %s damaged; making them again", desc, ", ".join(damaged) or "chunks", folder)
        (folder / COMPLETE).unlink(missing_ok=True)
    done = sum(rows[c] for c in range(len(starts)) if c not in todo)
    log.info("%s: %d of %d to make in %s", desc, total - done, total, folder)
    bar = tqdm(total=total, initial=done, desc=desc, disable=not progress)
    for c in todo:
        items = range(starts[c], starts[c] + rows[c])
        save_tensors(make_chunk(items).contiguous(), _chunk_path(folder, c))
        bar.update(len(items))
    bar.close()
    manifest = {"items": total, "chunks": len(starts), "chunk_size": chunk_size, "per_prompt": per_prompt}
    atomic_write(folder / COMPLETE, json.dumps(manifest))  # last: only now is the cache whole
    return load_latent_bank(folder, item_shape)


def _load_chunk(path: Path, rows: int, item_shape: tuple[int, ...] | None) -> torch.Tensor | None:
    """A chunk file's latents if it holds `rows` finite-shaped float rows of `item_shape`, else None."""
    try:
        chunk = torch.load(path, mmap=True, weights_only=True)
    except Exception:  # missing, truncated, garbage: torch raises several types; all mean "make it again"
        return None
    if not isinstance(chunk, torch.Tensor) or not chunk.is_floating_point() or chunk.dim() < 2 or len(chunk) != rows:
        return None
    return chunk if item_shape is None or tuple(chunk.shape[1:]) == tuple(item_shape) else None


def load_latent_bank(folder: str | os.PathLike, item_shape: tuple[int, ...] | None = None) -> LatentBank | None:
    """The bank in `folder` if its making finished and every chunk is whole, else None (a partial or
    damaged cache is never used)."""
    folder = Path(folder)
    try:
        m = json.loads((folder / COMPLETE).read_text())
        items, n, size, per = (int(m[k]) for k in ("items", "chunks", "chunk_size", "per_prompt"))
    except (OSError, ValueError, KeyError, TypeError):  # unfinished, or a damaged manifest: make it again
        return None
    loaded = [_load_chunk(_chunk_path(folder, c), min(size, items - c * size), item_shape) for c in range(n)]
    chunks = [c for c in loaded if c is not None]
    if len(chunks) != n or sum(len(c) for c in chunks) != items:
        return None
    if len({tuple(c.shape[1:]) for c in chunks}) != 1:
        return None
    return LatentBank(chunks, torch.arange(items) // per, size)
