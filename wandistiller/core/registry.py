"""The one registration idiom of every extension point (placements, data sources, losses, methods, hooks,
loggers).

An option is one module of its extension point's package that declares

    OPTION = Option("<name>", <its schema dataclass>, <its class>)

and nothing else registers it: `Registry` finds every such module, stores each schema in Hydra's ConfigStore
(`schema/<group>/<name>`, which the option's YAML names in its defaults, so a stray key is refused at
composition), and gives refusals and option lists their names. Packages outside WanDistiller add options the
same way (`WANDISTILLER_PLUGINS`: core/plugins.py). No code outside a registry names an option;
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

from omegaconf import MISSING
from omegaconf.errors import OmegaConfBaseException

from wandistiller.core.errors import UserError
from wandistiller.core.plugins import plugin_modules


@dataclass(frozen=True)
class Option:
    """One option: its name (its module's), its own config schema (a dataclass) and the class it builds."""

    name: str
    schema: type
    cls: type

    def __post_init__(self) -> None:
        if not dataclasses.is_dataclass(self.schema):
            raise TypeError(f"option {self.name!r}: its schema {self.schema!r} is not a dataclass")

    def defaults(self) -> dict[str, Any]:
        """Its schema's keys with their defaults, where the option's defaults are written (Hydra's `_target_` and
        `_partial_`, and keys without a default, left out)."""
        found = {}
        for field in dataclasses.fields(self.schema):
            if field.name.startswith("_") or not field.init:
                continue
            if field.default is not dataclasses.MISSING and field.default is not MISSING:
                found[field.name] = field.default
            elif field.default_factory is not dataclasses.MISSING:
                found[field.name] = field.default_factory()
        return found

    def build(self, **keys: Any) -> Any:
        """Its class built as its YAML-less node would build it: the schema's defaults, with `keys` in their place."""
        return self.cls(**(self.defaults() | keys))


class Registry:
    """The options of one extension point: the modules of `package` that define `OPTION`."""

    def __init__(self, group: str, package: str, what: str):
        self.group, self.package, self.what = group, package, what

    @functools.cached_property
    def options(self) -> dict[str, Option]:
        """Option name -> Option, in module-name order (imported once, on first use)."""
        found: dict[str, Option] = {}
        package = importlib.import_module(self.package)
        shipped = sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name)
        modules = [(m.name, f"{self.package}.{m.name}") for m in shipped] + plugin_modules(self.group)
        shipped_paths = {f"{self.package}.{m.name}" for m in shipped}
        for name, path in modules:
            try:
                module = importlib.import_module(path)
            except Exception as e:  # a plugin's own mistake (a bug, a missing dependency): one line naming it
                if path in shipped_paths:
                    raise
                first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
                raise UserError(
                    f"WANDISTILLER_PLUGINS: the plugin module {path} ({self.group}={name}) fails on import "
                    f"({type(e).__name__}: {first}); fix it, or drop its package from WANDISTILLER_PLUGINS"
                ) from None
            option = getattr(module, "OPTION", None)
            if option is None:
                continue
            if not isinstance(option, Option) or option.name != name:
                if path in shipped_paths:
                    raise TypeError(f"{path}.OPTION must be Option({name!r}, schema, class)")
                raise UserError(  # a plugin's: one line, as its import's failure is
                    f"WANDISTILLER_PLUGINS: {path}.OPTION must be Option({name!r}, schema, class), the option named as "
                    "its module is; fix it, or drop its package from WANDISTILLER_PLUGINS"
                )
            if name in found:  # a plugin's option (core/plugins.py) under a name already taken
                raise UserError(f"{path}: {self.group}={name} is already {path_of(found[name].cls)}; rename one")
            found[name] = option
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
        """Each option's schema as `schema/<group>/<name>` (the YAMLs of plugins are stored by core/plugins.py)."""
        for name, option in self.options.items():
            try:
                store.store(group=f"schema/{self.group}", name=name, node=option.schema)
            except OmegaConfBaseException as e:  # a plugin's schema with a field OmegaConf cannot type (a shipped
                first = str(e).strip().splitlines()[0][:200]  # one is tested)
                raise UserError(
                    f"WANDISTILLER_PLUGINS: {self.group}={name}'s schema {path_of(option.schema)} is not one "
                    f"OmegaConf can hold ({first}); give its fields int, float, str, bool, lists or dataclasses"
                ) from None
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
