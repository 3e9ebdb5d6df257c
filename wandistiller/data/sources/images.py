"""`data.latents=images` (`data=image_folder`, `data=pocket_digits`): x0 = real images encoded once with the
teacher's VAE, their captions the training prompts (wandistiller.data.images). The main rank encodes (or finds
them cached), the others read its cache; the last `data.val_fraction` of the images are held out for
validation, with their captions, unless `data.val_prompts_path` names the held-out prompts."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from wandistiller.config import DataCommon
from wandistiller.core.arch import Layout
from wandistiller.core.distributed import made_once
from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option
from wandistiller.data.images import (
    check_given_images,
    held_out_images,
    image_data,
    image_pairs,
    image_source,
    stills_only,
)
from wandistiller.data.latents import LatentBank
from wandistiller.data.prompts import encode_prompts, read_prompts
from wandistiller.data.sources.base import DataSource, Made, contents_record, own_name
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
    gives_images = True  # each an image-to-video teacher's given first frame (x0 Gaussian, as data=static_prompts)
    images_as_x0 = True  # a text-to-video teacher's x0 (one-frame latents)
    ranges = (("data.latent_chunk", lambda v: v > 0, "a positive integer"),)

    @classmethod
    def check(cls, data_cfg) -> None:

        image_source(data_cfg)

    @classmethod
    def check_with_teacher(cls, data_cfg, vae_config: dict, layout: Layout) -> None:
        if layout == Layout.t2v and data_cfg.latent_frames != 1:  # before anything is encoded
            raise UserError(stills_only(data_cfg.latent_frames))
        if layout != Layout.t2v:  # each image is given as a first frame: large enough, opaque (a text-to-video
            check_given_images(data_cfg, vae_config)  # teacher's x0 takes any image, scaled as it must be)

    @classmethod
    def contents(cls, data_cfg) -> dict:
        source = image_source(data_cfg)
        root = Path(data_cfg.root).expanduser() if data_cfg.root is not None else None
        return contents_record(source.captions, source.files, root, "images")

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
    def first_frames(cls, data_cfg, vae_config, count):
        return held_out_images(data_cfg, vae_config, count)

    @classmethod
    def make(cls, ctx, teacher, embeddings, val_embeddings) -> Made:
        # An image-to-video teacher takes each image as its given first frame; a text-to-video one as x0.
        return captioned_made(ctx, val_embeddings, image_pairs if ctx.spec.layout != Layout.t2v else image_data)


def captioned_made(ctx, val_embeddings, encoded) -> Made:
    """A captioned folder's Made (images or videos: `encoded` is image_data or video_data, giving (caption
    embeddings, x0 bank), or image_pairs or video_pairs, giving (embeddings, x0 bank or None, ImageBank)), encoded
    once on the main rank, with the last `data.val_fraction` of its captions (and their images) held out for
    validation."""

    def load(device, progress: bool):
        d = ctx.data_cfg
        found = encoded(ctx.spec, d, ctx.teacher_cfg, ctx.precision.teacher_dtype, device, ctx.cache_dir, progress)
        found = (*found, None)[:3]  # image_data and video_data give no ImageBank
        return found, held_out_captions(ctx, found[0], device)

    cpu = torch.device("cpu")
    (embeddings, bank, images), held_out = made_once(
        ctx.topo, lambda: load(ctx.device, True), lambda: load(cpu, False), makes=ctx.is_main
    )
    if held_out is None and images is not None:  # one (image, caption) pair: validated on itself, as one prompt is
        return Made(bank, embeddings, embeddings, images, images)
    if held_out is None:
        return Made(bank, embeddings, val_embeddings)
    val_embeddings, keep = held_out
    # Item i is caption i: the held-out ones are the last, so training draws the rest. The training prompts stop
    # there too: a method that draws prompts rather than items (dmd, trajectory's ODE) never trains on a held-out one.
    embeddings = replace(embeddings, prompts=embeddings.prompts[:keep], embeds=embeddings.embeds[:keep])
    if bank is not None:
        bank = LatentBank(bank.chunks, bank.prompt_idx[:keep], bank.chunk_size)
    if images is None:
        return Made(bank, embeddings, val_embeddings)
    return Made(bank, embeddings, val_embeddings, images.part(slice(None, keep)), images.part(slice(keep, None)))


def held_out_captions(ctx, embeddings, device):
    """(embeddings of the last `data.val_fraction` of the captions, how many images stay for training), so
    an image run validates on captions of its own that it never trained on; None where
    data.val_prompts_path names the held-out prompts, or there is one image only."""

    d, captions = ctx.data_cfg, embeddings.prompts  # caption i is image i's
    if d.val_prompts_path is not None or len(captions) < 2:
        return None
    train, held = split_prompts(captions, None, d.val_fraction)  # the split Images.held_out_prompts names
    if ctx.is_main:
        log.info(  # a video folder's clips come this way too: named by what the source holds
            "%s: the last %d of %d and their captions are held out for validation",
            "video clips" if str(d.get("latents")) == "videos" else "images",
            len(held),
            len(captions),
        )
    t = ctx.teacher_cfg
    held_emb = encode_prompts(
        ctx.spec, held, t.negative_prompt, t.max_sequence_length, ctx.precision.teacher_dtype, device, ctx.cache_dir
    )
    return held_emb, len(train)


OPTION = Option("images", ImagesConfig, Images)
