"""`data.latents=gaussian` (`data=static_prompts`, the default): data-free, x0 ~ N(0, I), drawn per step
by the batches themselves; nothing is made before training."""

from __future__ import annotations

from wandistiller.data.sources.base import DataSource


class Gaussian(DataSource):
    name = "gaussian"


SOURCE = Gaussian
