"""Data sources: where a run's clean latents x0 come from (`data.latents`), one module per source (gaussian,
teacher, images, videos; `base.DataSource` is the interface), and the held-out validation set.

`REGISTRY` is the one list of them: it finds every module defining `OPTION = Option(name, schema, class)`, gives
each source its own `data` schema (`/schema/data/<name>`, named by the YAMLs of `conf/data/`), and its value
checks to preflight's ordered refusals. A new source: one module here and one YAML in `conf/data/` (its
defaults name `/schema/data/<source>@_here_`), no other edit.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from wandistiller.core.arch import Layout
from wandistiller.core.errors import UserError
from wandistiller.core.files import read_json_in, write_in_run
from wandistiller.core.registry import Registry
from wandistiller.data.prompts import read_prompts
from wandistiller.data.sources.base import DataSource, Made
from wandistiller.data.validation import build_val_set, fill_targets

log = logging.getLogger("wandistiller")

REGISTRY = Registry("data", __name__, "a data source")


def sources() -> dict[str, type[DataSource]]:
    """`data.latents` value -> source class."""
    return {name: option.cls for name, option in REGISTRY.options.items()}


def range_checks(data_cfg) -> list[tuple[str, Any, Callable[[Any], bool], str]]:
    """(key, value, ok, what) of the chosen source's own keys, in its order (a key a run saved before it existed, as
    data.fps, is its default: None)."""
    return [(key, data_cfg.get(key.split(".", 1)[1]), ok, what) for key, ok, what in source_of(data_cfg).ranges]


def source_of(data_cfg) -> type[DataSource]:
    return sources()[str(data_cfg.latents)]


def check(data_cfg, vae_config: dict | None = None, layout: Layout = Layout.t2v) -> None:
    """The prompts files, then what the chosen source itself checks (its images and captions; with the teacher's
    VAE config and layout, what needs them: a video folder's clips, an image-to-video teacher's given images)."""

    read_prompts(data_cfg.prompts_path)
    if data_cfg.val_prompts_path is not None:
        read_prompts(data_cfg.val_prompts_path, key="data.val_prompts_path")
    source_of(data_cfg).check(data_cfg)
    if vae_config is not None:
        source_of(data_cfg).check_with_teacher(data_cfg, vae_config, layout)


# What a run's data files held at its first launch (`DataSource.contents`), beside its saved config.
CONTENTS = ".hydra/data.json"


def record_contents(run_dir: Path, data_cfg) -> None:
    """At a run's first launch: what its data files hold, which a resume and a later evaluation are held to."""
    contents = source_of(data_cfg).contents(data_cfg)
    if contents is not None:
        write_in_run(run_dir, CONTENTS, json.dumps(contents) + "\n")


def contents_problem(run_dir: Path, data_cfg) -> str | None:
    """How the run's data files differ from what they held at its first launch, in words (its held-out split is
    then another); None where they are the same, where nothing was recorded (a run of an earlier version), or where
    the run held out prompts of the user's own (data.val_prompts_path), none of the folder's."""
    if data_cfg.get("val_prompts_path"):  # none of the folder's held out: nothing of it to hold the run to
        return None
    try:
        recorded = (
            read_json_in(run_dir, CONTENTS, what="record of the run's data") if (run_dir / CONTENTS).is_file() else None
        )
    except ValueError:  # not JSON: a damaged record holds nothing to compare
        recorded = None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("digest"), str):
        return None
    now = source_of(data_cfg).contents(data_cfg)
    if now is None or now["digest"] == recorded["digest"]:
        return None
    # prompts_path null: the shipped prompts (a package update that edits them changes them too)
    key = next((f"data.{k}" for k in ("root", "dataset") if data_cfg.get(k) is not None), "data.prompts_path")
    count = recorded.get("items") if isinstance(recorded.get("items"), int) else "?"
    differ = "their text differs" if key == "data.prompts_path" else "their names, sizes or captions differ"
    given = data_cfg.get(key.split(".")[1])
    named = f"{key}={str(given)!r}" if given is not None else "the shipped prompts (data.prompts_path=null)"
    return f"{named} changed since the run first read it ({count} {now['what']} then, {now['items']} now, or {differ})"


def check_layout(data_cfg, layout: Layout, teacher_name: str) -> None:
    """An image-to-video teacher trained on prompts alone, or a text-to-video one on (image, prompt) pairs: refused
    in one line before anything is written (else the first teacher call fails inside a worker, or the images are
    silently dropped). TI2V 5B takes either: without an image it is a text-to-video model."""
    source = source_of(data_cfg)
    key = f"data.latents={source.name}"
    if layout == Layout.i2v and not source.gives_images:
        pairs = sorted(name for name, cls in sources().items() if cls.gives_images)
        fix = (
            f"use a source of (image, prompt) pairs (data.latents={' or '.join(pairs)})"
            if pairs
            else "no data source of this version gives (image, prompt) pairs yet; distil a text-to-video teacher"
        )
        raise UserError(
            f"{key} gives prompts alone, but teacher={teacher_name} is image-to-video: its experts take an image "
            f"beside each prompt; {fix}"
        )
    if layout != Layout.t2v and source.gives_images:  # the image-conditioned run: what it validates and draws
        if data_cfg.get("val_prompts_path"):
            raise UserError(
                f"data.val_prompts_path gives prompts alone, but teacher={teacher_name} is image-to-video: it "
                "validates on held-out images with their own captions (the last data.val_fraction of the data); "
                "drop data.val_prompts_path"
            )
        if int(data_cfg.get("latent_frames") or 1) < 2:  # a memory plan's one frame (bench plan) is a run too
            log.warning(
                "data.latent_frames=%s is the given image alone, but teacher=%s is image-to-video and learns to "
                "continue it: give clips, e.g. data.latent_frames=21 (81 frames through Wan's VAE; 5 for the pocket "
                "teachers' 9)",
                data_cfg.get("latent_frames"),
                teacher_name,
            )
    if layout == Layout.t2v and source.gives_images and not source.images_as_x0:
        raise UserError(
            f"{key} gives (image, prompt) pairs, but teacher={teacher_name} is text-to-video and takes no image; "
            "use an image-to-video teacher (Wan 2.1 I2V, Wan 2.2 I2V A14B or TI2V 5B), or a source of prompts"
        )


def image_conditioned(data_cfg, layout: Layout) -> bool:
    """Whether a run's batches carry an image: an image-to-video teacher (TI2V included) on a source of images.
    What samples such a run (sample grids, the collapse watch, the teacher's ODE, eval) does it through the model's
    own WanImageToVideoPipeline, each prompt from its own image."""
    return layout != Layout.t2v and source_of(data_cfg).gives_images


def training_data(ctx, teacher, embeddings, val_embeddings) -> Made:
    """x0 for training from the chosen source: None (Gaussian), the teacher's own samples, or encoded images
    (whose captions then replace the training and held-out prompts)."""
    return source_of(ctx.data_cfg).make(ctx, teacher, embeddings, val_embeddings)


def val_set(ctx, teacher, val_embeddings, val_images=None):
    """The held-out set with the teacher's targets filled in once, on the main rank (None elsewhere);
    `val_images` (an ImageBank over the held-out prompts): an image-to-video teacher's images for them."""

    held_out = build_val_set(
        val_embeddings, ctx.latent_shape, ctx.seed, ctx.spec.num_train_timesteps, images=val_images
    )
    box: list[Any] = [None]  # the targets tensor, broadcast from the main rank
    if ctx.makes_teacher_data:
        box = [fill_targets(held_out, lambda *a, **image: teacher.targets(*a, **image)[0]).targets]
    if ctx.topo.distributed:
        dist.broadcast_object_list(box, src=0)
    held_out.targets = box[0]
    return held_out if ctx.is_main else None


__all__ = [
    "REGISTRY",
    "DataSource",
    "Made",
    "check",
    "image_conditioned",
    "range_checks",
    "sources",
    "training_data",
    "val_set",
]
