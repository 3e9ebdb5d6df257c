"""Composing the Hydra config tree: registering every option's schema (the one place it happens), and checking a
command line's overrides before Hydra runs, with Hydra's errors as one line.

`config.py` holds the schemas alone; this module sits above the registries that give each option its own, and hands
them down: the layers below compose (wandistiller/core/hydra.py) and vet a received run's `_target_`s
(wandistiller/state/received.py) with what `register_configs` stored.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.types import ValueType
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from wandistiller.config import TrainConfig
from wandistiller.core.errors import UserError
from wandistiller.core.hydra import check_parses, compose_tree, hydra_error_line, parse_overrides, register_resolvers
from wandistiller.core.plugins import conf_options, store_plugin_yamls
from wandistiller.core.registry import Registry
from wandistiller.data.sources import REGISTRY as DATA_SOURCES
from wandistiller.job.checks import FOLDER_KEYS, check_missing
from wandistiller.job.resumed import trained_method
from wandistiller.placements import REGISTRY as PLACEMENTS
from wandistiller.recipe.hooks import REGISTRY as HOOKS
from wandistiller.recipe.losses import REGISTRY as LOSSES
from wandistiller.recipe.methods import REGISTRY as METHODS
from wandistiller.tracking.loggers import REGISTRY as LOGGERS


def register_configs() -> None:
    """The one place options are registered: the schema tree, every registry's option schemas (which the layers
    below then find in `wandistiller.core.registry.registered()`), the resolvers. Called by what composes or reads a
    run folder (each CLI's main, the train CLI on import), never by a layer below."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    for registry in registries():
        registry.register_schemas(store)
    store_plugin_yamls(store)  # the YAMLs of options from outside the package (WANDISTILLER_PLUGINS)
    register_resolvers()


def registries() -> tuple[Registry, ...]:
    """Every extension point's registry (placements, data sources, losses, methods, hooks, loggers)."""
    return PLACEMENTS, DATA_SOURCES, LOSSES, METHODS, HOOKS, LOGGERS


def check_overrides(argv: list[str]) -> None:
    """The command line's config overrides composed once before Hydra runs (each value of a sweep too), so
    a typo is one UserError line rather than Hydra's several lines and exit code 1. Flags and hydra.*
    overrides are Hydra's to check; nothing is loaded."""
    other_config = ("-cn", "--config-name", "-cp", "--config-path", "-cd", "--config-dir")
    if any(a.split("=", 1)[0] in other_config for a in argv):  # another primary config: Hydra checks it
        return
    given: list[str] = []  # the config's overrides (`~key` alone deletes one)
    hydra: list[str] = []  # hydra.* ones with a value: only their grammar is checked here
    for a in argv:
        if a.startswith("-") or not ("=" in a or a.startswith("~")):
            continue
        if not a.lstrip("+~").startswith("hydra"):
            given.append(a)
        elif "=" in a:
            hydra.append(a)
    check_parses(given)
    check_parses(hydra)
    base: list[str | None] = []
    try:
        both = parse_overrides(given + hydra)  # one search path set up, not one a list
        parsed, hydra_parsed = both[: len(given)], both[len(given) :]
        check_folder_values(parsed + hydra_parsed)
        check_sweeper_takes(parsed + hydra_parsed, argv)
        sweep = next((o for o in parsed + hydra_parsed if o.is_sweep_override()), None)
        if sweep is not None and not any(a in ("-m", "--multirun") for a in argv):
            key, value = str(sweep.input_line).split("=", 1)
            raise UserError(
                f"{sweep.input_line}: a comma makes it a sweep, which runs only with --multirun (-m); for one value "
                f"holding a comma, quote it: {key}='{value}'"
            )
        for o in hydra_parsed:  # a hydra.* sweep's emptiness too (its values are Hydra's to check)
            if o.is_sweep_override():
                _first(o)
        base = [o.input_line if not o.is_sweep_override() else _first(o) for o in parsed]
        variants = [base] + [
            base[:i] + [f"{o.get_key_element()}={v}"] + base[i + 1 :]
            for i, o in enumerate(parsed)
            if o.is_sweep_override() and o.is_choice_sweep()
            for v in list(o.sweep_string_iterator())[1:]
        ]
        for overrides in variants:
            check_missing(compose_tree("train", [o for o in overrides if o is not None]))  # before the run folder
        # Hydra's own keys and groups (hydra.run.dri=…, hydra/launcher=nope): was Hydra's block of lines, exit code 1
        own = [o.input_line for o in hydra_parsed if not o.is_sweep_override()]
        if own:
            compose_tree("train", [o for o in base if o is not None] + own, with_hydra=True)
    except (HydraException, OmegaConfBaseException) as e:
        line = hydra_error_line(e)
        method = _resumed_method(argv, [o for o in base if o is not None])
        if method:  # a key of the method a resumed run was trained with, without `method=` that chooses it
            line = line.split("; ")[0]  # Hydra's own words: the hint after them is the method's, below
            line = f"{line}; the run was trained with method={method}: add method={method}"
        raise UserError(line) from None


def check_folder_values(parsed) -> None:
    """A folder key given an empty value (`hydra.run.dir=$OUT` with OUT unset) is refused: Hydra reads it as the
    current directory, and a run there writes its checkpoints, student and logs among whatever that holds."""
    for override in parsed:
        key = override.get_key_element().lstrip("+~")
        if key in FOLDER_KEYS and not override.is_sweep_override() and not str(override.value()).strip():
            raise UserError(f"{key} is empty (an unset variable?); give it a folder, e.g. {key}={FOLDER_KEYS[key]}")


def _resumed_method(argv: list[str], overrides: list[str]) -> str | None:
    """The method the run a `trainer.resume=` continues was trained with, where the command line chooses none and
    choosing it composes the command line: what a refused override of one of its keys should name."""
    value = lambda key: next((a.split("=", 1)[1] for a in reversed(argv) if a.split("=", 1)[0] == key), None)
    resume, run_dir = value("trainer.resume"), value("hydra.run.dir")
    if not resume or any(o.lstrip("+~").split("=", 1)[0] == "method" for o in overrides):
        return None
    if resume == "auto" and (not run_dir or "${" in run_dir):  # a time-named folder: a new run, nothing saved
        return None
    method = trained_method(Path(run_dir or ".").expanduser(), resume)
    if method is None:
        return None
    try:
        compose_tree("train", [*overrides, f"method={method}"])
    except (HydraException, OmegaConfBaseException):
        return None
    return method


def _first(override) -> str | None:
    """A sweep override at its first value (None for an interval, which a sampling sweeper draws from)."""
    if override.value_type == ValueType.INTERVAL_SWEEP:
        return None
    first = next(iter(override.sweep_string_iterator()), None)
    key = override.get_key_element()
    if first is None and override.value_type == ValueType.RANGE_SWEEP:  # range(1,1): Hydra ran no job, said nothing
        raise UserError(f"{override.input_line} sweeps over nothing: the range is empty; give range(start,stop) with "
                        "stop past start, e.g. range(1,4)")  # fmt: skip
    if first is None:  # a glob() that matches nothing: Hydra would launch no job, and say nothing of why
        key = key.lstrip("+~")
        options = conf_options(key)
        said = f"the options of {key} are {' '.join(options)}" if options else f"{key} is not a config group"
        raise UserError(
            f"{override.input_line} sweeps over nothing: glob() matches a config group's options, and {said}; "
            "list values instead (key=a,b)"
        )
    return f"{key}={first}"


def check_sweeper_takes(parsed: list, argv: list[str]) -> None:
    """An interval (`interval(0,1)`) is drawn from by a sampling sweeper (Optuna's, Nevergrad's plugins); Hydra's
    basic one, the default, failed on it with a traceback."""
    interval = next((o for o in parsed if o.value_type == ValueType.INTERVAL_SWEEP), None)
    sweeper = next((a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("hydra/sweeper=")), "basic")
    if interval is not None and sweeper == "basic":
        raise UserError(
            f"{interval.input_line}: an interval is drawn from by a sampling sweeper (hydra/sweeper=optuna, from "
            "its plugin); Hydra's basic sweeper takes values (key=a,b) and range(start,stop,step)"
        )
