"""`data.latents=images` (`data=image_folder`, `data=pocket_digits`): x0 = real images encoded once with the
teacher's VAE, their captions the training prompts (wandistiller.data.images). The main rank encodes (or finds
them cached), the others read its cache; the last `data.val_fraction` of the images are held out for
validation, with their captions, unless `data.val_prompts_path` names the held-out prompts."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from wandistiller.config import DataCommon
from wandistiller.core.distributed import made_once
from wandistiller.core.registry import Option
from wandistiller.data.images import image_data, image_source
from wandistiller.data.latents import LatentBank
from wandistiller.data.prompts import encode_prompts, read_prompts
from wandistiller.data.sources.base import DataSource, Made, own_name
from wandistiller.data.validation import split_prompts

log = logging.getLogger("wandistiller")


OwnName = own_name("images", __name__)


@dataclass
class ImagesConfig(DataCommon):
    latents: OwnName = OwnName.images  # type: ignore[valid-type,attr-defined]  # an Enum made at import: its members are unseen by mypy
    # A folder of images with captions (.txt beside each, or captions.jsonl), or a Hugging Face `datasets`
    # folder (save_to_disk); columns None = detect "image" / "text"-like names.
    root: str | None = None
    dataset: str | None = None
    image_column: str | None = None
    text_column: str | None = None
    # Images encoded per cache chunk: an interrupted run keeps its finished chunks.
    latent_chunk: int = 16


class Images(DataSource):
    name = "images"
    description = "images"  # what the model card says the data was
    ranges = (("data.latent_chunk", lambda v: v > 0, "a positive integer"),)

    @classmethod
    def check(cls, data_cfg) -> None:

        image_source(data_cfg)

    @classmethod
    def held_out_prompts(cls, data_cfg, readable) -> list[str]:
        """An image run holds out the last `data.val_fraction` of its own captions (as held_out_captions below), or
        `data.val_prompts_path`'s prompts; the captions' folder is read only where `readable` lets it."""

        if data_cfg.get("val_prompts_path"):
            return read_prompts(data_cfg.val_prompts_path)
        for key in ("root", "dataset"):
            readable(key)
        return split_prompts(image_source(data_cfg).captions, None, data_cfg.get("val_fraction", 0.1))[1]

    @classmethod
    def make(cls, ctx, teacher, embeddings, val_embeddings) -> Made:
        return captioned_made(ctx, val_embeddings, image_data)


def captioned_made(ctx, val_embeddings, encoded) -> Made:
    """A captioned folder's Made (images or videos: `encoded` is image_data or video_data), encoded once on the
    main rank, with the last `data.val_fraction` of its captions held out for validation."""

    def load(device, progress: bool):
        d = ctx.data_cfg
        found = encoded(ctx.spec, d, ctx.teacher_cfg, ctx.precision.teacher_dtype, device, ctx.cache_dir, progress)
        return found, held_out_captions(ctx, found, device)

    cpu = torch.device("cpu")
    (embeddings, bank), held_out = made_once(
        ctx.topo, lambda: load(ctx.device, True), lambda: load(cpu, False), makes=ctx.is_main
    )
    if held_out is None:
        return Made(bank, embeddings, val_embeddings)
    val_embeddings, keep = held_out
    # Item i is caption i: the held-out ones are the last, so training draws the rest.
    return Made(LatentBank(bank.chunks, bank.prompt_idx[:keep], bank.chunk_size), embeddings, val_embeddings)


def held_out_captions(ctx, found, device):
    """(embeddings of the last `data.val_fraction` of the captions, how many images stay for training), so
    an image run validates on captions of its own that it never trained on; None where
    data.val_prompts_path names the held-out prompts, or there is one image only."""

    d, (embeddings, bank) = ctx.data_cfg, found
    if d.val_prompts_path is not None or len(bank) < 2:
        return None
    captions = [embeddings.prompts[i] for i in bank.prompt_idx.tolist()]
    train, held = split_prompts(captions, None, d.val_fraction)  # the split Images.held_out_prompts names
    if ctx.is_main:
        log.info(
            "image data: the last %d of %d images and their captions are held out for validation",
            len(held),
            len(captions),
        )
    t = ctx.teacher_cfg
    held_emb = encode_prompts(
        ctx.spec, held, t.negative_prompt, t.max_sequence_length, ctx.precision.teacher_dtype, device, ctx.cache_dir
    )
    return held_emb, len(train)


OPTION = Option("images", ImagesConfig, Images)
