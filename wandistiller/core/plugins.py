"""Options from outside the package: `WANDISTILLER_PLUGINS=mypkg,otherpkg` names importable packages whose
folders hold options laid out as the extension points' groups, one module and one YAML each, side by side:

    mypkg/method/fast.py                 OPTION = Option("fast", FastConfig, Fast)   (as a shipped method's module)
    mypkg/method/fast.yaml               defaults: [/schema/method/fast@_here_, _self_] ...   -> method=fast
    mypkg/teacher_placement/pinned.py    (the groups are the command line's: teacher_placement, data, loss,
    mypkg/teacher_placement/pinned.yaml   method, hooks, logger)

Each registry (core/registry.py) finds the plugin's modules of its group beside its own, and every
`<group>/<name>.yaml` of a plugin is stored in Hydra's ConfigStore under `<group>/<name>` (with the package its
`# @package` line names), so composition, option lists, refusals and runs see a plugin's option as a shipped
one. The variable is read where the registries are first used: set it for every command that composes, trains,
resumes or reads such a run.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from wandistiller.config import CONF_DIR
from wandistiller.core.errors import UserError
from wandistiller.core.files import read_text_in

ENV = "WANDISTILLER_PLUGINS"
_PACKAGE_LINE = re.compile(r"#\s*@package\s+(\S+)")


def plugin_packages() -> list[str]:
    """The packages `WANDISTILLER_PLUGINS` names (comma-separated), in its order."""
    return [name.strip() for name in os.environ.get(ENV, "").split(",") if name.strip()]


def plugin_folders() -> list[tuple[str, Path]]:
    """(package, folder) of each plugin package; one that cannot be found is one line naming the variable."""
    folders = []
    for package in plugin_packages():
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        except Exception as e:  # `pkg.sub` imports pkg, whose own code failed: a traceback of theirs, said in a line
            raise UserError(
                f"{ENV} names {package!r}, whose parent package fails on import ({type(e).__name__}: {e}); fix it, "
                f"or drop it from {ENV}"
            ) from None
        locations = list(spec.submodule_search_locations or []) if spec else []
        if not locations:
            raise UserError(
                f"{ENV} names {package!r}, which cannot be imported as a package; install it, add its parent folder "
                f"to PYTHONPATH, or drop it from {ENV}"
            )
        folders += [(package, Path(location)) for location in locations]
    return folders


def plugin_modules(group: str) -> list[tuple[str, str]]:
    """(module name, import path) of every plugin module of `group` (`mypkg/<group>/<name>.py`), by name."""
    found = [
        (file.stem, f"{package}.{group}.{file.stem}")
        for package, folder in plugin_folders()
        for file in sorted((folder / group).glob("*.py"))
        if file.stem != "__init__"
    ]
    return sorted(found)


def plugin_yamls(group: str) -> list[Path]:
    """Every plugin YAML of `group` (`mypkg/<group>/<name>.yaml`)."""
    return sorted(file for _, folder in plugin_folders() for file in (folder / group).glob("*.yaml"))


def conf_options(group: str) -> list[str]:
    """The options of a config group, the shipped ones (conf/<group>/) and the plugins': what refusals list."""
    return sorted({p.stem for p in (CONF_DIR / group).glob("*.yaml")} | {p.stem for p in plugin_yamls(group)})


def store_plugin_yamls(store: Any) -> None:
    """Every plugin's `<group>/<name>.yaml` stored as the option `<group>=<name>`; a name a shipped option of that
    group already has is one line (which of the two a run would compose is not for the search path to decide)."""
    seen: dict[tuple[str, str], Path] = {}
    for _, folder in plugin_folders():
        for file in sorted(folder.glob("*/*.yaml")):
            group = file.parent.name
            if not (CONF_DIR / group).is_dir():
                continue  # a folder of the package that is no config group (docs/, data/...): not an option
            if (CONF_DIR / group / file.name).exists():
                raise UserError(
                    f"{ENV}: {file} is the option {group}={file.stem}, which WanDistiller already ships; rename it"
                )
            if (group, file.stem) in seen:
                raise UserError(f"{ENV}: {file} and {seen[group, file.stem]} are both {group}={file.stem}; rename one")
            seen[group, file.stem] = file
            text = read_text_in(folder, f"{group}/{file.name}")  # never through a link out of the plugin
            header = next((m[1] for line in text.splitlines() if (m := _PACKAGE_LINE.match(line))), None)
            try:
                node = OmegaConf.create(text)
            except (yaml.YAMLError, OmegaConfBaseException) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise UserError(f"{ENV}: {file} is not a valid config ({first}); fix it") from None
            store.store(group=group, name=file.stem, node=node, package=header)
