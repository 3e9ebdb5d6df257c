"""`data.latents=videos` (`data=video_folder`): x0 = real clips, a folder of captioned video files decoded,
scaled down and center-cropped to the teacher's frame size, cut to the clip length `data.latent_frames` makes and
encoded once with the teacher's VAE (wandistiller.data.videos); their captions are the training prompts. The main
rank encodes (or finds them cached), the others read its cache; the last `data.val_fraction` of the videos are
held out for validation with their captions, as the images source holds out images."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from wandistiller.config import DataCommon
from wandistiller.core.arch import Layout
from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option
from wandistiller.data.prompts import read_prompts
from wandistiller.data.sources.base import DataSource, Made, contents_record, own_name
from wandistiller.data.sources.images import captioned_made
from wandistiller.data.validation import split_prompts
from wandistiller.data.videos import check_clips, folder_videos, held_out_first_frames, video_data, video_pairs

OwnName = own_name("videos", __name__)
log = logging.getLogger("wandistiller")


@dataclass
class VideosConfig(DataCommon):
    latents: OwnName = OwnName.videos  # type: ignore[valid-type,attr-defined]  # an Enum made at import: its members are unseen by mypy
    # A folder of videos (animated GIF/WebP; MP4, MOV, MKV, WebM, AVI with PyAV) with captions: a .txt beside
    # each, or captions.jsonl.
    root: str | None = None
    # Every frame_step-th frame of the file makes the clip (2 halves a 30 fps video's rate); from its start.
    frame_step: int = 1
    # Or the clip's frame rate: each file sampled at it by its frames' times (the frame shown at each 1/fps s), so
    # files stored at 24, 30 or 60 fps give clips that move alike. Wan 2.1/2.2 were trained at 16, TI2V 5B at 24.
    # Never above a file's own rate (no frame is shown twice). null: every frame_step-th frame, as stored.
    fps: float | None = None
    # Clips encoded per cache chunk: an interrupted run keeps its finished chunks.
    latent_chunk: int = 16


class Videos(DataSource):
    name = "videos"
    description = "video clips"  # what the model card says the data was
    gives_images = True  # each clip's first frame, an image-to-video teacher's given image (Wan's I2V training)
    images_as_x0 = True  # a text-to-video teacher takes the clips alone
    ranges = (
        ("data.frame_step", lambda v: v > 0, "a positive integer"),
        ("data.fps", lambda v: v is None or 0 < v < math.inf, "a positive, finite number of frames a second, or null"),
        ("data.latent_chunk", lambda v: v > 0, "a positive integer"),
    )

    @classmethod
    def check(cls, data_cfg) -> None:

        if data_cfg.root is None:
            raise UserError("data=video_folder: set data.root (a folder of videos with captions)")
        if data_cfg.get("fps") is not None and data_cfg.frame_step != 1:
            raise UserError(
                f"data.fps={data_cfg.fps:g} and data.frame_step={data_cfg.frame_step} both pick a clip's frames; "
                "set one of them (data.fps samples each file at one rate, whatever it is stored at)"
            )
        folder_videos(data_cfg.root)
        if data_cfg.latent_frames == 1:  # an audit's: trained on each video's first frame without a word
            log.warning(
                "data=video_folder with data.latent_frames=1 trains on each video's first frame alone, a still: no "
                "motion is learned; give data.latent_frames=5 or more for clips ((latent_frames - 1) x the VAE's "
                "time factor + 1 frames: 17 at a Wan VAE's 4x), or use data=image_folder for stills"
            )

    @classmethod
    def check_with_teacher(cls, data_cfg, vae_config: dict, layout: Layout) -> None:
        # A clip's first frame, an image-to-video teacher's given image, is as large as the clip; opaque, as a still.
        check_clips(data_cfg, vae_config, given=layout != Layout.t2v)

    @classmethod
    def contents(cls, data_cfg) -> dict:
        source = folder_videos(data_cfg.root)
        names = [source.name(i) for i in range(len(source.files))]
        return contents_record(source.captions, names, source.root, "videos")

    @classmethod
    def held_out_prompts(cls, data_cfg, readable) -> list[str]:
        """The last `data.val_fraction` of the videos' captions (or `data.val_prompts_path`'s prompts), as an
        image folder's; the folder is read only where `readable` lets it."""

        if data_cfg.get("val_prompts_path"):
            return read_prompts(data_cfg.val_prompts_path)
        readable("root")
        return split_prompts(folder_videos(data_cfg.root).captions, None, data_cfg.get("val_fraction", 0.1))[1]

    @classmethod
    def first_frames(cls, data_cfg, vae_config, count):
        return held_out_first_frames(data_cfg, vae_config, count)

    @classmethod
    def make(cls, ctx, teacher, embeddings, val_embeddings) -> Made:
        # An image-to-video teacher's given image is each clip's first frame; the clip itself is x0 either way.
        return captioned_made(ctx, val_embeddings, video_pairs if ctx.spec.layout != Layout.t2v else video_data)


OPTION = Option("videos", VideosConfig, Videos)
