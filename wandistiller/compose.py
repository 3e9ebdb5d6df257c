"""Composing the Hydra config tree: registering every option's schema (the one place it happens), the
resolvers, and composing a tree or one option outside a Hydra job, with Hydra's errors as one line.

`config.py` holds the schemas alone; this module sits above the registries that give each option its own.
"""

from __future__ import annotations

import datetime
import os
import re
import time
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from wandistiller.config import CONF_DIR, TrainConfig
from wandistiller.core.plugins import conf_options, store_plugin_yamls
from wandistiller.core.precision import auto_choice
from wandistiller.core.registry import Registry


def shared_now(fmt: str) -> str:
    """`${now:}` that every local rank started by torchrun agrees on: the launching agent's start time.

    Lets `torchrun -m wandistiller.train` ranks compute one run folder without talking to each other.
    """
    started = time.time()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            ticks = int(Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
            boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
            started = boot + ticks / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError, StopIteration):
            pass
    return datetime.datetime.fromtimestamp(started).strftime(fmt)


def rank_suffix() -> str:
    rank = int(os.environ.get("RANK", 0))
    return f"_rank{rank}" if rank else ""


def register_configs() -> None:
    """The one place options are registered: the schema tree, every registry's option schemas, the resolvers.
    Called by what composes (the train CLI's main, compose_config, a saved config's reader), never on import."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    for registry in registries():
        registry.register_schemas(store)
    store_plugin_yamls(store)  # the YAMLs of options from outside the package (WANDISTILLER_PLUGINS)
    OmegaConf.register_new_resolver("wd_now", shared_now, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("wd_rank_suffix", rank_suffix, replace=True)
    # A file shipped inside the package (the pocket teacher's folders): `${wd_assets:pocket/prompts.txt}`.
    OmegaConf.register_new_resolver("wd_assets", shipped_asset, replace=True)


def registries() -> tuple[Registry, ...]:
    """Every extension point's registry (placements, data sources, losses, methods, hooks, loggers)."""
    from wandistiller.data.sources import REGISTRY as data
    from wandistiller.placements import REGISTRY as placements
    from wandistiller.recipe.hooks import REGISTRY as hooks
    from wandistiller.recipe.losses import REGISTRY as losses
    from wandistiller.recipe.methods import REGISTRY as methods
    from wandistiller.tracking.loggers import REGISTRY as loggers

    return placements, data, losses, methods, hooks, loggers


def auto_precision(cfg, planned_gpus: int | None = None):
    """precision=auto's node replaced by the option it stands for (composed with its schema); another as it is.
    `planned_gpus`: plan for that many GPUs on paper (`hardware.gpus`), not for this machine."""
    return compose_option("precision", auto_choice(planned_gpus)) if cfg.name == "auto" else cfg


def resolve_precision(cfg) -> None:
    """Before a run: precision=auto becomes the concrete option, so the saved config, metrics.json and a
    resume on another machine all name the dtypes the run actually trained in."""
    if cfg.precision.name == "auto":
        for key, value in auto_precision(cfg.precision).items():  # key by key: the node keeps its schema
            cfg.precision[key] = value


def shipped_asset(rel: str = "") -> str:
    """`${wd_assets:REL}`: a path inside the package's assets, never outside it (received configs use it too)."""
    if ".." in Path(rel).parts or Path(rel).is_absolute():
        raise ValueError(f"wd_assets:{rel} leaves the package's assets; name a path inside them")
    return str(CONF_DIR.parent / "assets" / rel)


def compose_config(overrides: list[str]):
    """The tree `python -m wandistiller.train OVERRIDES` would run, composed outside a Hydra job (no run
    folder, no log file): for the planner's CLI and the tools. A bad override is one UserError."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from wandistiller.core.errors import UserError

    try:
        return _compose("train", modern_argv(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise UserError(hydra_error_line(e)) from None


def compose_option(group: str, option: str):
    """One config group option, composed by Hydra with its schema and defaults, its interpolations left
    for the tree it is put into to resolve (e.g. `teacher_placement=auto` becoming the planner's choice)."""
    return _compose(None, [f"+{group}={option}"])[group]


def _compose(config_name: str | None, overrides: list[str]):
    """Hydra's compose, inside a Hydra job (which already set the search path) or outside one."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    if GlobalHydra.instance().is_initialized():
        return compose(config_name, overrides=overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name, overrides=overrides)


def hydra_error_line(error: Exception) -> str:
    """Hydra's own words (its list of valid options included) and their cause, on one line, ending in a fix
    that works: Hydra's "+key=value" hint is dropped, since an added key the schema lacks is refused too."""
    words = [str(error)] + ([str(error.__cause__)] if error.__cause__ else [])
    lines = [line.strip() for w in words for line in w.splitlines() if line.strip()]
    skip = ("Config search path", "provider=", "full_key", "reference_type", "object_type", "To append to your config")
    text = " ".join(line for line in lines if not line.startswith(skip))
    if "override 'logger." in text and "not in struct" in text:  # a pre-release flat logger key
        return f"{text}; a logger's keys sit under its name: e.g. logger.wandb.mode=online"
    if "override 'hooks." in text and "not in struct" in text:  # a setting of a hook the list leaves out
        hooks = "hooks=[monitor,progress,samples,evaluate]"
        return f"{text}; that hook is not in the `hooks` list: add it (e.g. {hooks}) or drop the setting"
    if "not in" in text and "Key '" in text:
        return f"{text}; check its spelling (python -m wandistiller.train --cfg job lists every key)"
    if "override data.latents" in text:  # a source's schema takes its own name alone: the source is the option
        return f"{text}; choose the data source with data=<option> ({' '.join(_options('data'))})"
    if "Could not find" in text:
        return f"{text}; pick one of those options"
    missing = re.search(r"Could not load '([\w/]+)/([^'/]+)'", text)  # an option in a list: Hydra names none
    if missing and _options(missing[1]):
        options = _options(missing[1])
        return f"{text} Available options in '{missing[1]}': {' '.join(options)}; pick one of those options"
    return f"{text}; fix the value" if "could not be converted" in text or "Invalid value" in text else text


def _options(group: str) -> list[str]:
    return conf_options(group)


def check_overrides(argv: list[str]) -> None:
    """The command line's config overrides composed once before Hydra runs (each value of a sweep too), so
    a typo is one UserError line rather than Hydra's several lines and exit code 1. Flags and hydra.*
    overrides are Hydra's to check; nothing is loaded."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from wandistiller.core.errors import UserError
    from wandistiller.job.checks import check_missing

    other_config = ("-cn", "--config-name", "-cp", "--config-path", "-cd", "--config-dir")
    if any(a.split("=", 1)[0] in other_config for a in argv):  # another primary config: Hydra checks it
        return
    given = [
        a
        for a in argv
        if ("=" in a or a.startswith("~")) and not a.startswith("-") and not a.lstrip("+~").startswith("hydra")
    ]
    try:
        parsed = OverridesParser.create().parse_overrides(given)
        base = [o.input_line if not o.is_sweep_override() else _first(o) for o in parsed]
        variants = [base] + [
            base[:i] + [f"{o.get_key_element()}={v}"] + base[i + 1 :]
            for i, o in enumerate(parsed)
            if o.is_sweep_override() and o.is_choice_sweep()
            for v in list(o.sweep_string_iterator())[1:]
        ]
        for overrides in variants:
            check_missing(_compose("train", [o for o in overrides if o is not None]))  # before the run folder
    except (HydraException, OmegaConfBaseException) as e:
        line = hydra_error_line(e)
        method = _resumed_method(argv, [o for o in base if o is not None])
        if method:  # a key of the method a resumed run was trained with, without `method=` that chooses it
            line = line.split("; check its spelling")[0]
            line = f"{line}; the run was trained with method={method}: add method={method}"
        raise UserError(line) from None


def _resumed_method(argv: list[str], overrides: list[str]) -> str | None:
    """The method the run a `trainer.resume=` continues was trained with, where the command line chooses none and
    choosing it composes the command line: what a refused override of one of its keys should name."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from wandistiller.job.resumed import trained_method

    value = lambda key: next((a.split("=", 1)[1] for a in reversed(argv) if a.split("=", 1)[0] == key), None)  # noqa: E731
    resume, run_dir = value("trainer.resume"), value("hydra.run.dir")
    if not resume or any(o.lstrip("+~").split("=", 1)[0] == "method" for o in overrides):
        return None
    if resume == "auto" and (not run_dir or "${" in run_dir):  # a time-named folder: a new run, nothing saved
        return None
    method = trained_method(Path(run_dir or ".").expanduser(), resume)
    if method is None:
        return None
    try:
        _compose("train", [*overrides, f"method={method}"])
    except (HydraException, OmegaConfBaseException):
        return None
    return method


def modern_argv(argv: list[str]) -> list[str]:
    """The command line with each override of a renamed key rewritten to the current one (core/renamed.py), each with a
    warning on stderr: an older script still runs, and says what to write now."""
    import sys

    from wandistiller.core.renamed import modern_override

    rewritten, settings = [], []  # settings: the rewritten hook settings, kept where their hook is in the list
    for arg in argv:
        new, warning = modern_override(arg) if "=" in arg and not arg.startswith("-") else ([arg], None)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        rewritten += new
        settings += [n for n in new if n != arg and n.startswith("hooks.")]
    if not settings:
        return rewritten
    # A pre-release trainer key applied to every run; its hook may be left out of the `hooks` list (debug=fast has no
    # samples): there the setting had no effect, and it is dropped rather than refused.
    plain = [
        a
        for a in rewritten
        if a not in settings
        and "=" in a
        and "," not in a.split("=", 1)[1]
        and not a.startswith("-")
        and not a.lstrip("+~").startswith("hydra")
    ]
    try:
        present = set(_compose("train", plain + [a for a in rewritten if a.startswith("~")]).hooks)
    except Exception:  # the command line has another mistake: composing it again says which, in one line
        return rewritten
    return [a for a in rewritten if a not in settings or a.split(".")[1] in present]


def _first(override) -> str | None:
    """A sweep override at its first value (None for range/interval sweeps: Hydra checks those)."""
    if not override.is_choice_sweep():
        return None
    return f"{override.get_key_element()}={next(iter(override.sweep_string_iterator()))}"
