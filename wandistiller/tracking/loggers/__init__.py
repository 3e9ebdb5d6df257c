"""Loggers: one module per option of `conf/logger/` (wandb, tensorboard, csv), each holding its schema and its
class (`base.Logger` is the interface). The `logger` config node maps names to loggers, as in
lightning-hydra-template: `logger=[wandb,tensorboard,csv]` runs all three, `logger=none` none.

Adding a logger: one module here defining `OPTION = Option("<name>", <Name>Config, <Name>Logger)` and one YAML
`conf/logger/<name>.yaml` (`defaults: [/schema/logger/<name>@<name>, _self_]`, its keys under `<name>:`).
`REGISTRY` finds the module; tests/tracking/loggers/test_init.py is parametrised over every YAML.
"""

from __future__ import annotations

from hydra.utils import instantiate
from omegaconf import DictConfig

from wandistiller.core.registry import Registry
from wandistiller.tracking.loggers.base import Logger, Loggers, NullTracker

REGISTRY = Registry("logger", __name__, "a logger")


def entries(logger_cfg: DictConfig | dict | None) -> list[tuple[str, DictConfig]]:
    """(key, node) of each configured logger, in the config's order."""
    return [(str(k), v) for k, v in (logger_cfg or {}).items()]


def build(logger_cfg: DictConfig | None) -> Loggers:
    """Every configured logger, instantiated in the config's order, behind one `Loggers`."""

    return Loggers([instantiate(node) for _, node in entries(logger_cfg)])


__all__ = ["REGISTRY", "Logger", "Loggers", "NullTracker", "build"]
