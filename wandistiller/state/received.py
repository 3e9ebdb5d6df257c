"""A config read back from disk (a run folder's `.hydra/config.yaml`) is data someone may have sent you:
it is checked against the schema and an allow-list of `_target_`s before anything in it is instantiated
or even imported.

Hydra's `instantiate` calls whatever a `_target_` names, so a saved config that names
`pathlib.Path.write_text` or `pandas.read_pickle` runs code as the user. The allow-list holds what the
project registers (placements, the student builder) and every `_target_` the shipped `conf/` tree names
(optimizers, the loss, the recipe, the loggers), so it grows with the tree and never drifts from it.
A later registry (losses, loggers, data sources) adds its entries with `allow_targets(...)`.

Configs composed from the user's own command line or `--config-dir` stay as free as Hydra makes them:
their targets are passed in as `trusted` (a resume) or named with `--allow-target` (eval, generate).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import json
import re
import typing
from collections.abc import Iterable
from pathlib import Path

import torch.optim
import yaml
from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from wandistiller.config import CONF_DIR, StudentConfig, TrainConfig
from wandistiller.core.errors import UserError
from wandistiller.core.extensions import HYDRA_KEYS
from wandistiller.core.files import MAX_JSON_BYTES, read_text_in
from wandistiller.core.registry import path_of, registered
from wandistiller.core.renamed import modernize, modernize_lists
from wandistiller.data.sources import REGISTRY as DATA_SOURCES
from wandistiller.placements import REGISTRY as PLACEMENTS

# Resolvers a saved config may use: plain `${a.b}` references, the environment, and the ones the shipped
# tree uses. `oc.decode` / `oc.create` would build new nodes (a `_target_` among them) only when resolved.
SAFE_RESOLVERS = frozenset({"oc.env", "oc.select", "hydra", "now", "wd_now", "wd_rank_suffix", "wd_assets"})
_extra_targets: set[str] = set()


def allow_targets(*names: str) -> None:
    """Add `_target_`s a received config may name (a registry's own entries, registered at import)."""
    _extra_targets.update(names)


@functools.cache
def _shipped_targets() -> frozenset[str]:

    found = {StudentConfig._target_}
    for file in CONF_DIR.rglob("*.yaml"):
        found |= {t for _, t in _targets_in(yaml.safe_load(file.read_text()), "") if isinstance(t, str)}
    # Every torch optimizer: the shipped AdamW's siblings are what a user swaps in (`trainer.optimizer`).
    found |= {
        f"torch.optim.{name}"
        for name, obj in vars(torch.optim).items()
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer
    }
    return frozenset(found)


def registered_targets() -> set[str]:
    """The classes of every registered option, and their schemas' `_target_`s: the registries handed down by
    `wandistiller.compose.register_configs`, which each CLI calls before it reads a run folder (without it a
    shipped option's class would be refused as if the config named a stranger's)."""
    if not registered():
        raise RuntimeError("no registry is registered: call wandistiller.compose.register_configs() first")
    options = [option for registry in registered() for option in registry.options.values()]
    found = {path_of(option.cls) for option in options}
    return found | {t for option in options if isinstance(t := getattr(option.schema, "_target_", None), str)}


def allowed_targets() -> frozenset[str]:
    """Every `_target_` a received config may name."""
    return _shipped_targets() | registered_targets() | _extra_targets


def targets_of(cfg: DictConfig | dict | None) -> set[str]:
    """The `_target_` values of a config the user composed themselves (trusted as they are)."""
    if cfg is None:
        return set()
    tree = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, (DictConfig, ListConfig)) else cfg
    return {t for _, t in _targets_in(tree, "") if isinstance(t, str)}


def _targets_in(node, prefix: str) -> Iterable[tuple[str, object]]:
    """(key, value) of every `_target_` in a plain tree, nested in dicts and lists."""
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if k == "_target_":
                yield key, v
            else:
                yield from _targets_in(v, key)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _targets_in(v, f"{prefix}[{i}]")


TRUST_HINT = "pass --allow-target {target}"  # eval, generate; a resume names the key on its command line


def _plugin_hint(target: object) -> str:
    """Where a refused target is laid out as an option of a package of the user's own (`PKG.<group>.<name>.Cls`,
    core/plugins.py), the setting that registers that package's options; else nothing."""
    parts = target.split(".") if isinstance(target, str) else []
    groups = {registry.group for registry in registered()}
    at = next((i for i in range(1, len(parts) - 2) if parts[i] in groups), None)  # PKG may be dotted
    if at is None or parts[0] == "wandistiller":
        return ""
    package = ".".join(parts[:at])
    return f" (if {package} is a package of options you installed, set WANDISTILLER_PLUGINS={package})"


def load_received(file: Path, trusted: Iterable[str] = (), root: Path | None = None) -> DictConfig:
    """A saved config, read as data (inside `root`, its run folder: see `bounded_text`) and checked; a damaged file
    is one line. See `check_received`."""
    try:
        raw = load_yaml_config(file, root=root)
    except UserError:
        raise
    except Exception as e:  # YAML's own errors, an unreadable file: the run folder is damaged either way
        raise UserError(f"{file} cannot be read ({type(e).__name__}); restore it from a copy of the run") from None
    if not isinstance(raw, DictConfig):
        raise UserError(f"{file} is damaged (not a saved config); restore it from a copy of the run")
    return check_received(raw, file, trusted)


def check_received(raw: DictConfig, file: Path, trusted: Iterable[str] = (), hint: str = TRUST_HINT) -> DictConfig:
    """`raw` merged into the schema, after its targets and interpolations are checked: nothing in it is
    imported, resolved or called first. Each refusal is one line naming the key and the file. `_target_`s
    of a pre-release run (core/renamed.py) are first rewritten, in place, to their current paths."""
    modernize(raw)
    modernize_lists(raw)
    tree = OmegaConf.to_container(raw, resolve=False)
    _check_interpolations(tree, "", file)
    allowed = allowed_targets() | set(trusted)
    for key, target in _targets_in(tree, ""):
        if not isinstance(target, str) or target not in allowed:
            plugin = _plugin_hint(target)
            raise UserError(
                f"{key}={target!r} in {file} is not a WanDistiller component; a received config may only name "
                "the project's own classes (and torch optimizers): remove it, or if you trust it "
                + hint.format(key=key, target=target)
                + plugin
            )
    data_schema = _data_schema(raw, file)
    tree = OmegaConf.to_container(raw, resolve=False)  # again: _data_schema dropped another source's keys
    assert isinstance(tree, dict)  # raw is a DictConfig
    _check_keys(tree, file)

    try:
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), raw)
        if data_schema is not None:  # the data node typed by its source's own schema, as a composed one is
            merged.data = OmegaConf.merge(OmegaConf.structured(data_schema), merged.data)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{key} in {file}: {first}; fix or remove it (the file does not match the schema)") from None
    OmegaConf.set_struct(merged, True)
    assert isinstance(merged, DictConfig)  # the schema is a mapping
    return merged


def _data_schema(raw: DictConfig, file: Path):
    """The saved `data` node's source schema (data/sources/<latents>.py). A config saved when one flat schema held
    every source's keys carries the others' too: those are dropped, in place; a key of no source is refused."""
    data = raw._get_node("data") if "data" in raw else None
    if not isinstance(data, DictConfig) or "latents" not in data:
        return None  # the schema merge names what is wrong
    latents = data._get_node("latents")._value()  # type: ignore[union-attr]  # a key `in` the node has its node
    if not isinstance(latents, str) or latents not in DATA_SOURCES.options:
        return None  # the schema merge names what is wrong
    own = {f.name for f in dataclasses.fields(DATA_SOURCES.get(latents).schema)}
    anyone = {f.name for o in DATA_SOURCES.options.values() for f in dataclasses.fields(o.schema)}
    for key in [k for k in data.keys() if k not in own]:
        if key not in anyone:
            raise UserError(f"data.{key!s} in {file} is not a WanDistiller config key; remove it")
        del data[key]
    return DATA_SOURCES.get(latents).schema


def _check_interpolations(node, prefix: str, file: Path) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            _check_interpolations(v, f"{prefix}.{k}" if prefix else str(k), file)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_interpolations(v, f"{prefix}[{i}]", file)
    elif isinstance(node, str) and "${" in node:
        bad = sorted({r for r in re.findall(r"\$\{\s*([\w.]+)\s*:", node) if r not in SAFE_RESOLVERS})
        if bad or (prefix.endswith("_target_")):
            what = f"uses the resolver {bad[0]}" if bad else "is an interpolation"
            raise UserError(f"{prefix}={node!r} in {file} {what}, which a received config may not; remove it")


def _check_keys(tree: dict, file: Path) -> None:
    """Every key under a typed node is a field of its schema; a target's node holds only its arguments."""

    def walk(schema, node, prefix: str) -> None:
        if not isinstance(node, dict):
            return
        if schema is None:
            if "_target_" in node:
                _check_arguments(node, prefix, file)
            elif prefix in ("logger.", "hooks."):  # named loggers and hooks, each a target's node
                for name, entry in node.items():
                    walk(None, entry, f"{prefix}{name}.")
            return
        fields = {f.name for f in dataclasses.fields(schema)}
        for key, value in node.items():
            if key not in fields:
                raise UserError(f"{prefix}{key} in {file} is not a WanDistiller config key; remove it")
            walk(_schema_of(schema, key), value, f"{prefix}{key}.")

    walk(TrainConfig, tree, "")


def _schema_of(schema, key: str):
    hint = typing.get_type_hints(schema).get(key)
    return hint if dataclasses.is_dataclass(hint) else None


def _check_arguments(node: dict, prefix: str, file: Path) -> None:
    """An allowed target's node: its keys bind to the target's signature (a placement: its schema's fields)."""

    options = PLACEMENTS.options.values()  # a placement's node holds its schema's fields (its class takes none)
    by_class = {path_of(o.cls): o.schema for o in options}
    by_class |= {str(getattr(o.schema, "_target_", "")): o.schema for o in options}  # each placement schema has one
    kwargs = {k: v for k, v in node.items() if k not in HYDRA_KEYS}
    schema = by_class.get(node["_target_"])
    if schema is not None:
        unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(schema)})
    else:
        try:
            params = inspect.signature(get_object(node["_target_"])).parameters.values()
        except (ValueError, TypeError, ImportError, AttributeError):
            return  # no signature to bind to (a builtin): instantiate will say
        if any(p.kind == p.VAR_KEYWORD for p in params):
            return
        unknown = sorted(set(kwargs) - {p.name for p in params})
    if unknown:
        raise UserError(f"{prefix}{unknown[0]} in {file} is not an argument of {node['_target_']}; fix or remove it")


def local_cache_dir() -> str:
    """This machine's `paths.cache_dir` (the shipped default, from WANDISTILLER_CACHE or ~/.cache): a received
    run's caches go here, never into the folder its sender chose."""

    default = yaml.safe_load((CONF_DIR / "train.yaml").read_text())["paths"]["cache_dir"]
    return str(OmegaConf.create({"cache_dir": default}).cache_dir)


def looks_like_hub_id(path: str) -> bool:
    """`owner/name` that is not a local path: diffusers would download it."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~")) and not Path(path).expanduser().exists()


# -- bounded reads of received files ----------------------------------------------------------------------------
MAX_CONFIG_BYTES = 256 * 2**10  # a saved config is a few KB; this is generous and checks in well under a second
MAX_YAML_NODES = 50_000  # after expanding aliases: a 1 KB "billion laughs" expands to 10^9
MAX_YAML_DEPTH = 100


def bounded_text(path: Path, limit: int, what: str = "file", root: Path | None = None) -> str:
    """`path`'s text, refused in one line (UserError) if larger than `limit` bytes -- checked before reading,
    and by reading at most `limit + 1` bytes (a FIFO, /dev/zero or a growing file cannot pin the reader). Opened
    through the guard (core.files.open_in) inside `root`, the folder it was received in (default: its own folder):
    a link leading out of it is refused, never followed."""

    path = Path(path)
    return read_text_in(path.parent if root is None else root, path, limit, what)


def yaml_size_problem(text: str) -> str | None:
    """Why parsing `text` as YAML could blow up, in words, or None: counts the nodes it would build with every
    alias expanded (YAML's "billion laughs") and how deep it nests, from the parser's events alone."""
    sizes: dict[str, int] = {}  # anchor -> nodes under it
    stack: list[list] = []  # open collections: [anchor, nodes so far]
    total = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                stack.append([event.anchor, 1])
                if len(stack) > MAX_YAML_DEPTH:
                    return f"nests more than {MAX_YAML_DEPTH} deep"
                continue
            if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                anchor, n = stack.pop()
            elif isinstance(event, yaml.ScalarEvent):
                anchor, n = event.anchor, 1
            elif isinstance(event, yaml.AliasEvent):
                anchor, n = None, sizes.get(event.anchor, 1)
            else:
                continue
            if anchor is not None:
                sizes[anchor] = n
            if stack:
                stack[-1][1] += n
            else:
                total += n
            if total + sum(s[1] for s in stack) > MAX_YAML_NODES:
                return f"expands to more than {MAX_YAML_NODES:,} values (aliases of aliases)"
    except yaml.YAMLError:
        return None  # not YAML: the loader that follows says so, as it always has
    return None


def load_yaml_config(path: Path, what: str = "saved config", root: Path | None = None):
    """A received YAML file (a run's `.hydra/config.yaml`, `overrides.yaml`) as an OmegaConf node, its size,
    aliases and depth bounded before OmegaConf builds anything: one UserError line otherwise."""

    text = bounded_text(path, MAX_CONFIG_BYTES, what, root)
    problem = yaml_size_problem(text)
    if problem:
        raise UserError(f"{path} {problem}, which no {what} does; restore it from a copy of the run")
    return OmegaConf.load(io.StringIO(text))


def load_json(path: Path, limit: int | None = None, what: str = "JSON file", root: Path | None = None):
    """A received JSON file, its size bounded before parsing and its nesting caught: UserError (one line), or
    ValueError for text that is not JSON (the caller says what the file is for)."""
    text = bounded_text(path, limit or MAX_JSON_BYTES, what, root)
    try:
        return json.loads(text)
    except RecursionError:
        raise UserError(f"{path} is nested too deeply to be a {what}") from None
