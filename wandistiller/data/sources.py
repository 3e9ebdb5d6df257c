"""Where a run's clean latents x0 come from (`data.latents`), and its held-out validation set, built in
the processes that need them: the rank that holds a teacher makes what needs one, the others read the
cache it wrote (text embeddings work the same way)."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from wandistiller.core.distributed import barrier
from wandistiller.data.latents import LatentBank, SamplerSettings, latents_folder, load_latent_bank, teacher_latents
from wandistiller.data.validation import build_val_set, fill_targets
from wandistiller.placements.base import guidance_scales

log = logging.getLogger("wandistiller")


def makers(recipe) -> bool:
    """Whether this rank makes what needs the teacher: rank 0 (which always holds one), or every rank of a
    teacher whose forwards are collectives."""
    return recipe.teacher is not None and (recipe.topo.rank == 0 or recipe.placement.collective)


def training_latents(recipe):
    """(LatentBank or None, the training embeddings when they change): Gaussian x0 needs nothing; teacher
    latents are the teacher's own samples of the training prompts; images are encoded with its VAE."""
    kind = str(recipe.cfg.data.latents)
    if kind == "gaussian":
        return None, None
    if kind == "images":
        return _image_latents(recipe)
    cfg, spec = recipe.cfg, recipe.spec
    settings = SamplerSettings(
        cfg.data.sample_steps,
        tuple(guidance_scales(spec, cfg.teacher)),
        recipe.latent_shape(),
        cfg.data.latents_per_prompt,
    )
    bank = None
    if makers(recipe):
        bank = teacher_latents(recipe.teacher, recipe.embeddings, cfg.seed, settings, cfg.paths.cache_dir,
                               cfg.data.latent_chunk, progress=recipe.topo.rank == 0)  # fmt: skip
    barrier(recipe.topo)
    if bank is None:
        folder = latents_folder(spec, recipe.embeddings, cfg.seed, settings, recipe.precision.teacher_dtype,
                                cfg.paths.cache_dir)  # fmt: skip
        bank = load_latent_bank(folder)
    return bank, None


def _image_latents(recipe):
    from wandistiller.data.images import image_data

    cfg = recipe.cfg
    args = (recipe.spec, cfg.data, cfg.teacher, recipe.precision.teacher_dtype)
    if recipe.is_main:
        found = image_data(*args, recipe.device, cfg.paths.cache_dir, progress=True)
        held_out = _held_out_captions(recipe, found, recipe.device)
    barrier(recipe.topo)  # the main rank encoded them; the others read its cache
    if not recipe.is_main:
        found = image_data(*args, torch.device("cpu"), cfg.paths.cache_dir, progress=False)
        held_out = _held_out_captions(recipe, found, torch.device("cpu"))
    embeddings, bank = found
    if held_out is None:
        return bank, embeddings
    recipe.val_embeddings, keep = held_out
    # Images and captions are item i = prompt i: the held-out ones are the last, so training draws the rest.
    return LatentBank(bank.chunks, bank.prompt_idx[:keep], bank.chunk_size), embeddings


def _held_out_captions(recipe, found, device):
    """(embeddings of the last `data.val_fraction` of the captions, how many images stay for training), so
    an image run validates on captions of its own that it never trained on; None where
    data.val_prompts_path names the held-out prompts, or there is one image only."""
    from wandistiller.data.prompts import encode_prompts
    from wandistiller.data.validation import split_prompts

    cfg, (embeddings, bank) = recipe.cfg, found
    if cfg.data.val_prompts_path is not None or len(bank) < 2:
        return None
    captions = [embeddings.prompts[i] for i in bank.prompt_idx.tolist()]
    train, held = split_prompts(captions, None, cfg.data.val_fraction)
    if recipe.is_main:
        log.info("image data: the last %d of %d images and their captions are held out for validation", len(held),
                 len(captions))  # fmt: skip
    t = cfg.teacher
    held_emb = encode_prompts(recipe.spec, held, t.negative_prompt, t.max_sequence_length,
                              recipe.precision.teacher_dtype, device, cfg.paths.cache_dir)  # fmt: skip
    return held_emb, len(train)


def val_set(recipe):
    """The held-out set with the teacher's targets filled in once, on the main rank (None elsewhere)."""
    cfg = recipe.cfg
    if cfg.trainer.val_every > cfg.trainer.max_steps:
        log.warning("trainer.val_every=%d > trainer.max_steps=%d: no validation will run",
                    cfg.trainer.val_every, cfg.trainer.max_steps)  # fmt: skip
    held_out = build_val_set(recipe.val_embeddings, recipe.latent_shape(), cfg.seed, recipe.spec.num_train_timesteps)
    box = [None]
    if makers(recipe):
        box = [fill_targets(held_out, lambda *a: recipe.teacher.targets(*a)[0]).targets]
    if recipe.topo.distributed:
        dist.broadcast_object_list(box, src=0)
    held_out.targets = box[0]
    return held_out if recipe.is_main else None
