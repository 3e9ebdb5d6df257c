"""`data.latents=gaussian` (`data=static_prompts`, the default): data-free, x0 ~ N(0, I), drawn per step
by the batches themselves; nothing is made before training."""

from __future__ import annotations

from dataclasses import dataclass

from wandistiller.config import DataCommon
from wandistiller.core.registry import Option
from wandistiller.data.sources.base import DataSource, own_name

OwnName = own_name("gaussian", __name__)


@dataclass
class GaussianConfig(DataCommon):
    latents: OwnName = OwnName.gaussian  # type: ignore[valid-type,attr-defined]  # an Enum made at import: its members are unseen by mypy


class Gaussian(DataSource):
    name = "gaussian"
    description = "Gaussian x0 (data-free)"  # what the model card says the data was


OPTION = Option("gaussian", GaussianConfig, Gaussian)
