"""Loggers: one module per option of `conf/logger/` (wandb, tensorboard, csv), each holding its schema and its
class (`base.Logger` is the interface). The `logger` config node maps names to loggers, as in
lightning-hydra-template: `logger=[wandb,tensorboard,csv]` runs all three, `logger=none` none.

Adding a logger: one module here defining `OPTION = (<Name>Config, <Name>Logger)` and one YAML
`conf/logger/<name>.yaml` (`defaults: [/schema/logger/<name>@<name>, _self_]`, its keys under `<name>:`). The
registry below finds the module; tests/tracking/loggers/test_init.py is parametrised over every YAML.
"""

from __future__ import annotations

from omegaconf import DictConfig

from wandistiller.core.extensions import modules_defining
from wandistiller.tracking.loggers.base import Logger, Loggers, NullTracker
from wandistiller.tracking.loggers.wandb import WandbTracker, offline_segments


def options() -> dict[str, tuple[type, type]]:
    """option name (the module's, as `conf/logger/<name>.yaml` is) -> (config schema, logger class), from every
    module of this package that has an OPTION."""
    return modules_defining(__name__, __path__, "OPTION")


def register_schemas(store) -> None:
    for name, (schema, _) in options().items():
        store.store(group="schema/logger", name=name, node=schema)


def entries(logger_cfg: DictConfig | dict | None) -> list[tuple[str, DictConfig]]:
    """(key, node) of each configured logger, in the config's order."""
    return [(str(k), v) for k, v in (logger_cfg or {}).items()]


def build(logger_cfg: DictConfig | None) -> Loggers:
    """Every configured logger, instantiated in the config's order, behind one `Loggers`."""
    from hydra.utils import instantiate

    return Loggers([instantiate(node) for _, node in entries(logger_cfg)])


__all__ = ["Logger", "Loggers", "NullTracker", "WandbTracker", "build", "offline_segments", "options"]
