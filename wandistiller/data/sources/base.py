"""The interface every data source implements: where a run's clean latents x0 come from (`data.latents`).

A source is one module of this package defining `OPTION = Option("<name>", <its schema>, <its class>)`; the
registry (`__init__.py`) finds it, stores its schema for `conf/data/*.yaml` to name (`/schema/data/<name>@_here_`),
and adds its value checks to preflight. So a new source is that module plus a YAML in `conf/data/`, and no other edit:

    name           its `data.latents` value
    gives_images   whether its samples come with the image an image-to-video teacher is conditioned on
    images_as_x0   whether a text-to-video teacher trains on those images (or clips) as x0 instead
    schema         `DataCommon` + the `data.*` keys it adds (typed, with defaults), `latents` its own name alone
    ranges         (key, ok(value), "what a good value is") for its keys: refused in one line, in order
    check(data)    refuse what only it can see (its files), before the run folder is claimed
    check_with_teacher(data, vae_config, layout)   the same for what needs the teacher's VAE and layout (frames a
                   clip takes, an image-to-video teacher's given images)
    held_out_prompts(data, readable)   the prompts validation holds out, for an evaluation of the run
    make(ctx, teacher, embeddings, val_embeddings) -> Made: the training latents on every rank
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

from wandistiller.config import Choice
from wandistiller.core.arch import Layout
from wandistiller.data.prompts import read_prompts
from wandistiller.data.validation import split_prompts

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig

    from wandistiller.core.distributed import Topology
    from wandistiller.core.precision import Precision
    from wandistiller.data.conditions import ImageBank
    from wandistiller.data.latents import LatentBank
    from wandistiller.data.prompts import PromptEmbeddings
    from wandistiller.teacher.model import Teacher
    from wandistiller.teacher.spec import TeacherSpec


class SourceContext(Protocol):
    """What a source reads of the run's context (the recipe's `RunContext`, which sits above the data: each source
    is given it, and names none of the recipe's types)."""

    @property
    def data_cfg(self) -> DictConfig: ...
    @property
    def teacher_cfg(self) -> DictConfig: ...
    @property
    def seed(self) -> int: ...
    @property
    def cache_dir(self) -> str: ...
    @property
    def spec(self) -> TeacherSpec: ...
    @property
    def topo(self) -> Topology: ...
    @property
    def precision(self) -> Precision: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def is_main(self) -> bool: ...
    @property
    def makes_teacher_data(self) -> bool: ...
    @property
    def latent_shape(self) -> tuple[int, int, int, int]: ...


@dataclass(frozen=True)
class Made:
    """What a source gives the run: the latent bank (None: Gaussian x0) and the prompt embeddings training and
    validation then use (an image source's are its captions')."""

    bank: LatentBank | None
    embeddings: PromptEmbeddings
    val_embeddings: PromptEmbeddings
    # An image-to-video teacher's conditioning per training prompt and per held-out one (None: text alone).
    images: ImageBank | None = None
    val_images: ImageBank | None = None


def own_name(name: str, module: str) -> type[Choice]:
    """The type of a source schema's `latents`: its own name alone, so `data.latents=<another>` is refused at
    composition (the source is chosen by `data=<option>`, whose schema holds that source's keys). Kept in its
    module as `OwnName`, where pickling (a config sent to worker processes) finds it."""
    made = Choice("OwnName", {name: name}, module=module, qualname="OwnName")  # type: ignore[call-overload]  # Enum's functional API: typeshed sees str()
    return cast(type[Choice], made)


class DataSource:
    name: ClassVar[str]
    description: ClassVar[str] = ""  # the data in words, for the model card
    # Whether its x0 are the teacher's own samples, made with its whole sampler before training (hours at scale).
    samples_teacher: ClassVar[bool] = False
    # Whether each sample comes with the image an image-to-video teacher is conditioned on ((image, prompt) pairs);
    # a text-to-video teacher takes none, an I2V one needs one (TI2V 5B takes either: check_layout).
    gives_images: ClassVar[bool] = False
    # Whether a text-to-video teacher takes its images as x0 instead (an image or video folder): else a source of
    # images is refused for one (check_layout), which would drop them.
    images_as_x0: ClassVar[bool] = False
    ranges: ClassVar[tuple[tuple[str, Callable[[Any], bool], str], ...]] = ()

    @classmethod
    def check(cls, data_cfg: DictConfig) -> None:
        """Refuse, in one UserError line, what this source cannot use (missing files, no captions)."""

    @classmethod
    def check_with_teacher(cls, data_cfg: DictConfig, vae_config: dict[str, Any], layout: Layout) -> None:
        """Refuse, in one line, what only the teacher's VAE and layout show this source cannot use (a video
        folder's clips too short or too small for its frames, an image an image-to-video teacher cannot be given),
        once its config is known and before the run folder is claimed."""

    @classmethod
    def contents(cls, data_cfg: DictConfig) -> dict[str, Any] | None:
        """What the user's data files held when read (`contents_record`), which a resume and a later evaluation are
        held to: files added, removed or recaptioned since make another held-out split. Here, for a source of
        prompts alone (the teacher's own samples, Gaussian x0): the prompts file's lines (a resume after it was
        edited trained on other prompts and held out others, without a word)."""
        return contents_record(read_prompts(data_cfg.prompts_path), None, None, "prompts")

    @classmethod
    def held_out_prompts(cls, data_cfg: DictConfig, readable: Callable[[str], None]) -> list[str]:
        """The prompts validation holds out (never trained on), for an evaluation of the run: the last
        `data.val_fraction` of the prompts file, or `data.val_prompts_path`'s. `readable(key)` refuses a data
        folder the caller may not read (a received run's)."""

        prompts = read_prompts(data_cfg.prompts_path)
        held_out: list[str] = split_prompts(
            prompts, data_cfg.get("val_prompts_path"), data_cfg.get("val_fraction", 0.1)
        )[1]
        return held_out

    @classmethod
    def held_out_first_frames(
        cls, data_cfg: DictConfig, vae_config: dict[str, Any], readable: Callable[[str], None]
    ) -> list[Any] | None:
        """The given first frames (PIL images at the run's frame size) of `held_out_prompts`, one each, for an
        image-to-video run's evaluation; None where those prompts have none (prompts alone, or a source's
        `data.val_prompts_path`: the user's own prompts)."""
        if not cls.gives_images or data_cfg.get("val_prompts_path"):
            return None
        return cls.first_frames(data_cfg, vae_config, len(cls.held_out_prompts(data_cfg, readable)))

    @classmethod
    def first_frames(cls, data_cfg: DictConfig, vae_config: dict[str, Any], count: int) -> list[Any]:
        """A source that gives images (`gives_images`): the last `count` captions' images, fitted to the run's
        frame size as training fits them."""
        raise NotImplementedError(f"data.latents={cls.name} gives no images")

    @classmethod
    def make(
        cls,
        ctx: SourceContext,
        teacher: Teacher | None,
        embeddings: PromptEmbeddings,
        val_embeddings: PromptEmbeddings,
    ) -> Made:
        """The training latents, built where the run's context says (every rank calls it)."""
        return Made(None, embeddings, val_embeddings)


def contents_record(captions: list[str], names: list[str] | None, root: Path | None, what: str) -> dict[str, Any]:
    """{"items": how many, "what": their kind ("images"), "digest": of their names, sizes and captions} (a
    dataset's rows: captions alone): what a run's data held, whatever folder it lies in now (a moved or copied
    folder keeps it)."""
    sizes = [(root / name).stat().st_size for name in names] if names is not None and root is not None else None
    digest = hashlib.sha256(json.dumps([names, sizes, captions]).encode()).hexdigest()[:16]
    return {"items": len(captions), "what": what, "digest": digest}
