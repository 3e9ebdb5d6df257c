"""The one registration idiom of every extension point (placements, data sources, losses, methods, hooks,
loggers).

An option is one module of its extension point's package that declares

    OPTION = Option("<name>", <its schema dataclass>, <its class>)

and nothing else registers it: `Registry` finds every such module, stores each schema in Hydra's ConfigStore
(`schema/<group>/<name>`, which the option's YAML names in its defaults, so a stray key is refused at
composition), and gives refusals and option lists their names. No code outside a registry names an option;
it asks the registry (`names()`, `where(...)`, `get(name)`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from wandistiller.core.errors import UserError


@dataclass(frozen=True)
class Option:
    """One option: its name (its module's), its own config schema (a dataclass) and the class it builds."""

    name: str
    schema: type
    cls: type

    def __post_init__(self) -> None:
        if not dataclasses.is_dataclass(self.schema):
            raise TypeError(f"option {self.name!r}: its schema {self.schema!r} is not a dataclass")


class Registry:
    """The options of one extension point: the modules of `package` that define `OPTION`."""

    def __init__(self, group: str, package: str, what: str):
        self.group, self.package, self.what = group, package, what

    @functools.cached_property
    def options(self) -> dict[str, Option]:
        """Option name -> Option, in module-name order (imported once, on first use)."""
        found: dict[str, Option] = {}
        package = importlib.import_module(self.package)
        for module in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
            option = getattr(importlib.import_module(f"{self.package}.{module.name}"), "OPTION", None)
            if option is None:
                continue
            if not isinstance(option, Option) or option.name != module.name:
                raise TypeError(f"{self.package}.{module.name}.OPTION must be Option({module.name!r}, schema, class)")
            found[option.name] = option
        return found

    def names(self) -> list[str]:
        return list(self.options)

    def get(self, name: str) -> Option:
        """The option called `name`; a name that is none of them is one line listing those that are."""
        if name not in self.options:
            raise UserError(f"{self.group}={name!r} is not {self.what}; pick one of {', '.join(self.names())}")
        return self.options[name]

    def where(self, test: Callable[[type], bool]) -> list[str]:
        """The names of the options whose class passes `test` (`lambda cls: cls.fp8`): for refusals that list them."""
        return [name for name, option in self.options.items() if test(option.cls)]

    def classes(self) -> Iterator[type]:
        return (option.cls for option in self.options.values())

    def of_target(self, target: str) -> Option | None:
        """The option a `_target_` builds (its class's path, or its schema's default `_target_`)."""
        for option in self.options.values():
            if target in (path_of(option.cls), getattr(option.schema, "_target_", None)):
                return option
        return None

    def register_schemas(self, store: Any) -> None:
        for name, option in self.options.items():
            store.store(group=f"schema/{self.group}", name=name, node=option.schema)
        _registered[self.group] = self


# The registries whose schemas are in Hydra's ConfigStore, by group: stored by `register_schemas`, which
# `wandistiller.compose.register_configs` calls for every one before anything composes or reads a run folder.
_registered: dict[str, Registry] = {}


def registered() -> tuple[Registry, ...]:
    """Every registry registered with Hydra so far: how a layer below the registries' own packages (the received
    config's check, the preflight) asks about their options without importing them."""
    return tuple(_registered.values())


def path_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
