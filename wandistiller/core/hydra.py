"""Hydra composition for every layer: the resolvers, composing the train tree or one option outside a Hydra job,
precision=auto made concrete, and Hydra's errors as one line.

The options' schemas are stored above, by `wandistiller.compose.register_configs`, which knows every registry; each
CLI calls it before anything composes or reads a run folder, so the layers below compose without calling up.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import NoReturn

from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser  # Hydra's own: what it accepts is what check_hydra_flags reads
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from wandistiller.config import CONF_DIR
from wandistiller.core.errors import UserError
from wandistiller.core.plugins import conf_options
from wandistiller.core.precision import auto_choice
from wandistiller.core.renamed import modern_override


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


def shipped_asset(rel: str = "") -> str:
    """`${wd_assets:REL}`: a path inside the package's assets, never outside it (received configs use it too)."""
    if ".." in Path(rel).parts or Path(rel).is_absolute():
        raise ValueError(f"wd_assets:{rel} leaves the package's assets; name a path inside them")
    return str(CONF_DIR.parent / "assets" / rel)


def register_resolvers() -> None:
    """The resolvers the shipped tree and a saved config may use (idempotent)."""
    OmegaConf.register_new_resolver("wd_now", shared_now, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("wd_rank_suffix", rank_suffix, replace=True)
    # A file shipped inside the package (the pocket teacher's folders): `${wd_assets:pocket/prompts.txt}`.
    OmegaConf.register_new_resolver("wd_assets", shipped_asset, replace=True)


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


def compose_config(overrides: list[str]):
    """The tree `python -m wandistiller.train OVERRIDES` would run, composed outside a Hydra job (no run
    folder, no log file): for the planner's CLI and the tools. A bad override is one UserError."""
    overrides = modern_argv(overrides)
    check_parses(overrides)
    try:
        return compose_tree("train", overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise UserError(hydra_error_line(e)) from None


def check_parses(overrides: list[str]) -> None:
    """Each override Hydra's grammar cannot read (`trainer..max_steps=3`, an unclosed list, a sweep ending in a comma)
    is one line naming it and the way to write it (Hydra's parser says neither)."""
    for one in overrides:
        try:
            OverridesParser.create().parse_overrides([one])
        except HydraException as e:
            words = " ".join(str(e).split()).split(" See https")[0][:160]
            key, _, value = one.partition("=")
            if not value.isascii():  # Hydra's grammar takes letters beyond ASCII only quoted (a path, a project name)
                raise UserError(
                    f"{one} is not an override Hydra can read ({words}): a value with characters beyond ASCII goes in "
                    f"quotes, '{key}=\"{value}\"' (the outer quotes for the shell)"
                ) from None
            raise UserError(
                f"{one} is not an override Hydra can read ({words}); write key=value with one dot between keys "
                "(trainer.max_steps=3), a list closed (hooks=[monitor,progress]), a sweep as key=a,b with -m"
            ) from None


def compose_option(group: str, option: str):
    """One config group option, composed by Hydra with its schema and defaults, its interpolations left
    for the tree it is put into to resolve (e.g. `teacher_placement=auto` becoming the planner's choice)."""
    return compose_tree(None, [f"+{group}={option}"])[group]


def compose_tree(config_name: str | None, overrides: list[str], with_hydra: bool = False):
    """Hydra's compose, inside a Hydra job (which already set the search path) or outside one; `with_hydra`: Hydra's
    own node composed too (where an option of its groups, `hydra/launcher=…`, is checked)."""
    if "train_schema.yaml" not in ConfigStore.instance().repo:
        raise RuntimeError("nothing is registered to compose: call wandistiller.compose.register_configs() first")
    register_resolvers()
    if config_name == "train":
        overrides = experiment_in_place(overrides)
    with _search_path():
        return compose(config_name, overrides=overrides, return_hydra_config=with_hydra)


def experiment_in_place(overrides: list[str]) -> list[str]:
    """`+experiment=x` as `experiment=x`, both spellings choosing it: the tree lists `experiment: null` ahead of
    `debug` so that debug=fast's few steps win over an experiment's, and Hydra appends a `+group` only where its
    list holds none (a run saved before lists `+experiment=`)."""
    return [o[1:] if o.startswith("+experiment=") else o for o in overrides]


def parse_overrides(overrides: list[str]) -> list:
    """Hydra's parse of overrides, given the config loader a `glob()` sweep lists its group's options with (the
    bare parser has none, and enumerating such a sweep failed with "ConfigLoader is not set")."""
    with _search_path():
        return OverridesParser.create(GlobalHydra.instance().config_loader()).parse_overrides(overrides)


def _search_path() -> contextlib.AbstractContextManager:
    """Hydra's search path: a Hydra job's own (already set), else the package's conf/ for the call."""
    if GlobalHydra.instance().is_initialized():
        return contextlib.nullcontext()
    return initialize_config_dir(config_dir=str(CONF_DIR), version_base=None)


def hydra_error_line(error: Exception) -> str:
    """Hydra's own words (its list of valid options included) and their cause, on one line, ending in a fix
    that works: Hydra's "+key=value" hint is dropped, since an added key the schema lacks is refused too."""
    words = [str(error)] + ([str(error.__cause__)] if error.__cause__ else [])
    lines = [line.strip() for w in words for line in w.splitlines() if line.strip()]
    skip = ("Config search path", "provider=", "full_key", "reference_type", "object_type", "To append to your config")
    text = " ".join(line for line in lines if not line.startswith(skip))
    unlisted = re.search(r"override 'logger\.(\w+)\.", text)
    if unlisted and "not in struct" in text and unlisted[1] in _options("logger"):  # a logger the list leaves out
        example = f"logger=[{unlisted[1]},csv]"
        return f"{text}; that logger is not in the `logger` list: add it (e.g. {example}) or drop the setting"
    if "override 'logger." in text and "not in struct" in text:  # the flat keys of before the logger list
        return f"{text}; a logger's keys sit under its name: e.g. logger.wandb.mode=online"
    if "override 'hooks." in text and "not in struct" in text:  # a setting of a hook the list leaves out
        hooks = "hooks=[monitor,progress,samples,evaluate]"
        return f"{text}; that hook is not in the `hooks` list: add it (e.g. {hooks}) or drop the setting"
    deleted = re.search(r"override ~([\w.]+) \w+ \(DictConfig\) does not support deletion", text)
    if deleted:  # a key of a typed node: the schema requires it
        return f"{text}; {deleted[1]} is required, so it cannot be removed: set it instead ({deleted[1]}=…)"
    if "Could not delete" in text:  # `~` of a key or an option the config does not have
        return (
            f"{text}; `~` removes only a hook, a logger or a key added with + (e.g. ~hooks.evaluate): set this one "
            "instead (key=…), or check its spelling (python -m wandistiller.train --cfg job lists every key)"
        )
    entry = re.search(r"Could not override '([\w.]+)'\. Key '([^']+)' is not in struct", text)
    if entry and "." in entry[1]:  # a map's entry it lacks (hydra.job.env_set.FOO, max_memory.0): added with +
        full, key = entry[1], entry[2]
        added = full if full.endswith(f".{key}") else f"{full}.{key}"
        return f"{text}; an entry a map does not have yet is added with +: +{added}=…"
    if "not in" in text and "Key '" in text:
        hint = _other_options_key(text) or "check its spelling"
        lists = "--cfg hydra lists Hydra's keys" if "override 'hydra." in text else "--cfg job lists every key"
        return f"{text}; {hint} (python -m wandistiller.train {lists})"
    if "override data.latents" in text:  # a source's schema takes its own name alone: the source is the option
        return f"{text}; choose the data source with data=<option> ({' '.join(_options('data'))})"
    if "Could not find" in text:
        return f"{text}; pick one of those options"
    missing = re.search(r"Could not load '([\w/]+)/([^'/]+)'", text)  # an option in a list: Hydra names none
    if missing and _options(missing[1]):
        options = _options(missing[1])
        return f"{text} Available options in '{missing[1]}': {' '.join(options)}; pick one of those options"
    if "is not a valid bool" in text:  # hardware.show_plan=maybe: Hydra's words named no value it takes
        return f"{text}; use true or false"
    return f"{text}; fix the value" if "could not be converted" in text or "Invalid value" in text else text


def _other_options_key(text: str) -> str | None:
    """Where a key refused as unknown is one of another option of its group (`data.root` with data=static_prompts,
    a resumed run's `data.root` without its `data=image_folder`): the options that have it, and how to choose one;
    where an experiment set it for an option it chooses, that a choice beside it displaced."""
    experiment = re.search(r"In '(experiment/[\w-]+)'", text)
    if experiment:
        return (
            f"+{experiment[1].replace('/', '=')} sets keys of the options it chooses, and another option given "
            "beside it lacks this one: drop that choice (e.g. data=…), or give the experiment's own"
        )
    override = re.search(r"Could not override '(\w+)\.(\w+)", text)
    if not override or not _options(override[1]):
        return None
    group, key = override[1], override[2]
    if f"Key '{key}'" not in text:  # a key inside it (a map's) was refused, not the key itself: its option has it
        return None
    try:
        holders = [o for o in _options(group) if key in compose_option(group, o)]
    except Exception:  # only a better hint was lost: the line stands as Hydra said it
        return None
    if not holders:
        return None
    return (
        f"{group}.{key} is a key of {', '.join(f'{group}={o}' for o in holders)}, not of the {group} option "
        f"chosen: choose one with it (e.g. {group}={holders[0]} {group}.{key}=…; a resume, the run's own)"
    )


def _options(group: str) -> list[str]:
    return conf_options(group)


def modern_argv(argv: list[str]) -> list[str]:
    """The command line with every override of a moved key rewritten to today's (core/renamed.py), each with a
    warning on stderr: an older script still runs, and says what to write now."""
    rewritten, settings = [], []  # settings: the rewritten hook settings, kept where their hook is in the list
    for arg in experiment_in_place(argv):
        new, warning = modern_override(arg) if "=" in arg and not arg.startswith("-") else ([arg], None)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        rewritten += new
        settings += [n for n in new if n != arg and n.startswith("hooks.")]
    if not settings:
        return rewritten
    # An older trainer key applied to every run; its hook may be left out of today's list (debug=fast has no
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
        present = set(compose_tree("train", plain + [a for a in rewritten if a.startswith("~")]).hooks)
    except Exception:  # the command line has another mistake: composing it again says which, in one line
        return rewritten
    return [a for a in rewritten if a not in settings or a.split(".")[1] in present]


# The old train_distillation.py's flags and the override each became (docs/USAGE.md's table).
LEGACY_FLAGS = {
    "--teacher_path": "teacher.path=P",
    "--teacher_on_cpu": "teacher_placement=cpu",
    "--teacher_device_strategy": "teacher_placement=S",
    "--teacher_dtype": "precision=bf16 (or precision.teacher_dtype=…)",
    "--mixed_precision": "precision=bf16",
    "--gradient_checkpointing": "trainer.gradient_checkpointing=true",
    "--batch_size": "trainer.batch_size=N",
    "--student_config": "student=from_json student.config_path=F",
    "--data_path": "data.prompts_path=F",
    "--output_dir": "hydra.run.dir=D",
    "--distributed": "distributed.nproc_per_node=N",
}


def check_hydra_flags(argv: list[str]) -> None:
    """Hydra's own flags checked where Hydra's refusal is a traceback or a block of lines, read as Hydra reads them
    (its own parser: abbreviations such as `--mult`, joined flags such as `-cjob`): two modes at once (`-m … --cfg
    job`: a sweep's config printed), `--resolve` without `--cfg`, a `--config-dir` or `--config-name` that is not
    there, `--config-path` not a folder, Hydra's `--experimental-rerun` (a pickle no run here writes). `--help` goes
    first, as in Hydra."""
    parser = get_args_parser()

    def refuse(message: str) -> NoReturn:  # a flag Hydra cannot parse: its usage block twice, then its line
        raise UserError(f"{message}; python -m wandistiller.train --help lists Hydra's flags")

    parser.error = refuse  # type: ignore[method-assign]
    args, unknown = parser.parse_known_args(argv)
    if args.help or args.hydra_help:
        return
    old = next((a.split("=", 1)[0] for a in unknown if a.split("=", 1)[0] in LEGACY_FLAGS), None)
    if old is not None:  # Hydra's usage block and "unrecognized arguments" named no override to write instead
        raise UserError(
            f"{old} is the old train_distillation.py's flag; write {LEGACY_FLAGS[old]} instead (docs/USAGE.md, "
            "'From the old train_distillation.py', maps each)"
        )
    split = [a for a in unknown if not a.startswith("-")]
    if split:  # argparse takes one run of overrides: Hydra's usage block said "unrecognized arguments" of the rest
        raise UserError(
            f"{' '.join(split)}: the overrides go together, all before or all after the flags (e.g. "
            f"python -m wandistiller.train {shlex.join(a for a in argv if a not in args.overrides + split)} "
            f"{shlex.join(args.overrides + split)})"
        )
    modes = {
        "--run": args.run,
        "--multirun": args.multirun,
        "--cfg": args.cfg is not None,
        "--info": args.info is not None,
        "--shell-completion": args.shell_completion,
    }
    given = [name for name, on in modes.items() if on]
    if len(given) > 1:
        hint = (
            "; to see one sweep point's config, drop -m and give each swept key one value"
            if {"--multirun", "--cfg"} <= set(given)
            else ""
        )
        raise UserError(f"{' with '.join(given)}: Hydra takes one of {', '.join(modes)} at a time{hint}")
    if args.resolve and args.cfg is None:
        raise UserError("--resolve resolves the config that --cfg prints: give it with --cfg job, or drop it")
    if args.experimental_rerun is not None:
        raise UserError(
            "--experimental-rerun: no run here leaves the pickle Hydra reruns; continue a run with "
            "hydra.run.dir=<its folder> trainer.resume=auto"
        )
    primary = CONF_DIR
    if args.config_path is not None and not args.config_path.startswith("pkg://"):
        primary = CONF_DIR.parent / args.config_path  # as Hydra reads it: from the main module's folder
        if not primary.is_dir():
            raise UserError(f"--config-path {args.config_path}: no such folder (the default is the package's conf/)")
    config_dir = Path(os.path.abspath(args.config_dir)) if args.config_dir is not None else None  # as Hydra reads it
    if config_dir is not None and not config_dir.is_dir():
        raise UserError(f"--config-dir {args.config_dir}: no such folder; give a folder of config files, or drop it")
    if args.config_name is not None:
        file = args.config_name.removesuffix(".yaml") + ".yaml"
        folders = [primary, *([config_dir] if config_dir is not None else [])]
        if not any((folder / file).is_file() for folder in folders) and file not in ConfigStore.instance().repo:
            raise UserError(
                f"--config-name {args.config_name}: no such config (the training config is train, the default; "
                "--config-dir adds a folder of your own)"
            )
