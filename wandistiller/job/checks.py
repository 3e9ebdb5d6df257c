"""The config's own values, checked before anything is read from disk: keys the schema does not know, numbers
out of range, `_target_`s that cannot be imported or called, the optimizer and schedule built once on a dummy
parameter, the folders a run writes, each logger's own refusals and every `${…}`. Each refusal is one UserError
line naming the key and the fix; `preflight.prepare` runs them first, in its order."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import os
import re
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_method, get_object, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from wandistiller.config import CONF_DIR, TrainConfig, hardware_problem
from wandistiller.core.distributed import under_torchrun
from wandistiller.core.errors import UserError, quieted
from wandistiller.core.extensions import check_signatures
from wandistiller.core.files import folder_problem, run_holding
from wandistiller.core.plugins import conf_options
from wandistiller.data import sources as data_sources
from wandistiller.placements.steptime import Passes
from wandistiller.recipe.hooks.base import Hook
from wandistiller.recipe.losses import Loss, as_loss
from wandistiller.recipe.methods.base import Method
from wandistiller.state.received import looks_like_hub_id

log = logging.getLogger("wandistiller")


def check_known_keys(cfg: DictConfig) -> None:
    """Hydra's `+key=value` adds a key the schema does not know, so `+trainer.bacth_size=2` would be
    ignored in silence: every key under a typed node must be one of its schema's fields."""

    def walk(schema, node: DictConfig, prefix: str) -> None:
        fields = {f.name: f for f in dataclasses.fields(schema)}
        for key in node.keys():
            if key not in fields:
                raise UserError(
                    f"{prefix}{key!s} is not a WanDistiller option (it was added with +); check its spelling "
                    f"(`python -m wandistiller.train --cfg job` lists the options)"
                )
            sub = _schema_of(schema, key, node[key])
            if sub is not None and isinstance(node[key], DictConfig):
                walk(sub, node[key], f"{prefix}{key}.")

    walk(TrainConfig, cfg, "")


def name_the_teacher(cfg: DictConfig) -> None:
    """`teacher.path=<folder or Hub id>` over a group's teacher (the default `tiny`): the run's teacher is then
    that folder, so `teacher.name` becomes its name (or the Hub id) and `builtin` goes; the plan, the saved
    config and metrics.json said "tiny" of a 14B model. A name that is no group option is the user's own."""

    group = CONF_DIR / "teacher" / f"{cfg.teacher.name}.yaml"
    if not group.is_file():
        return
    given, shipped = (OmegaConf.to_container(node, resolve=False) for node in (cfg.teacher, OmegaConf.load(group)))
    assert isinstance(given, dict) and isinstance(shipped, dict)  # a teacher node is a mapping
    path = str(given["path"])
    if path == str(shipped.get("path")):
        return

    with open_dict(cfg):
        cfg.teacher.name = path if looks_like_hub_id(path) else Path(path).expanduser().name or path
        cfg.teacher.builtin = None


@functools.cache
def _type_hints(schema: type) -> dict:
    """A dataclass's field types: its string annotations (`from __future__ import annotations`) evaluated once, not
    once for each key a check walks (63,000 evaluations in the test suite's runs)."""
    return typing.get_type_hints(schema)


def _schema_of(schema, key: str, node=None):
    """The dataclass that types `schema.key`: its field's, or for an untyped (Any) node the option schema it was
    composed with (a placement's, a data source's, a loss's); None for a node of no schema."""

    hint = _type_hints(schema).get(key)
    if dataclasses.is_dataclass(hint):
        return hint
    composed = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    return composed if dataclasses.is_dataclass(composed) else None


def check_values(cfg: DictConfig) -> None:
    """Values the schema's types cannot catch, each named with its key and a fix."""
    t, d = cfg.trainer, cfg.data
    for key, value in [
        ("trainer.batch_size", t.batch_size),
        ("trainer.grad_accum_steps", t.grad_accum_steps),
        ("trainer.max_steps", t.max_steps),
        ("trainer.checkpoint_every", t.checkpoint_every),
        ("trainer.log_every", t.log_every),
        ("data.latent_frames", d.latent_frames),
        ("data.latent_height", d.latent_height),
        ("data.latent_width", d.latent_width),
        ("distributed.nproc_per_node", cfg.distributed.nproc_per_node),
        ("distributed.nnodes", cfg.distributed.nnodes),
    ]:
        if value <= 0:
            raise UserError(f"{key}={value} must be a positive integer")
    for key, value in _at_least_zero(cfg):
        if value < 0:
            raise UserError(f"{key}={value} must be 0 or more")
    check_ranges(cfg)
    if d.latent_height % 2 or d.latent_width % 2:
        raise UserError(
            f"data.latent_height/latent_width ({d.latent_height}x{d.latent_width}) must be even (Wan patches 2x2)"
        )
    if cfg.distributed.nnodes > 1 and not cfg.distributed.rdzv_endpoint and not under_torchrun():
        raise UserError("distributed.nnodes>1 needs distributed.rdzv_endpoint=HOST:PORT of the first node")
    endpoint = cfg.distributed.rdzv_endpoint
    if endpoint and endpoint_problem(str(endpoint)):  # torch's ValueError was an internal error, its folder left
        raise UserError(
            f"distributed.rdzv_endpoint={endpoint}: {endpoint_problem(str(endpoint))}; give HOST:PORT of the first "
            "node, e.g. node0:29500"
        )


def endpoint_problem(endpoint: str) -> str | None:
    """What is wrong with a rendezvous HOST:PORT (a bare HOST takes torchrun's default port), else None."""
    host, colon, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
    bracketed = host.startswith("[") and host.endswith("]")  # an IPv6 address: [::1]:29500
    if not host or any(c.isspace() for c in host) or (":" in host and not bracketed):
        return "no host name before the port" if not host else "not a host name"
    if colon and not (port.isdigit() and 1 <= int(port) <= 65535):
        return f"the port {port!r} is not a number from 1 to 65535"
    return None


def _at_least_zero(cfg: DictConfig) -> list[tuple[str, float]]:
    t = cfg.trainer
    return [
        ("trainer.warmup_steps", t.warmup_steps),
        ("trainer.keep_checkpoints", t.keep_checkpoints),
    ]


def check_ranges(cfg: DictConfig) -> None:
    """Numbers with a meaning only in some range; each refusal says the range (`None` = the default)."""
    t, d, teacher = cfg.trainer, cfg.data, cfg.teacher
    checks: list[tuple[str, Any, Callable[[Any], bool], str]] = [
        ("teacher.max_sequence_length", teacher.max_sequence_length, lambda v: 0 < v <= 4096, "in [1, 4096]"),
        ("data.latent_frames", d.latent_frames, lambda v: v <= MAX_LATENT, f"at most {MAX_LATENT}"),
        ("data.latent_height", d.latent_height, lambda v: v <= MAX_LATENT, f"at most {MAX_LATENT}"),
        ("data.latent_width", d.latent_width, lambda v: v <= MAX_LATENT, f"at most {MAX_LATENT}"),
        *data_sources.range_checks(d),  # each source's own keys (wandistiller/data/sources/)
        ("data.val_fraction", d.val_fraction, lambda v: 0 <= v < 1, HELD_OUT),
        ("trainer.ema_decay", t.ema_decay, lambda v: v is None or 0 <= v < 1, "in [0, 1), or null for no EMA"),
        ("trainer.max_grad_norm", t.max_grad_norm, lambda v: v is None or v > 0, "positive, or null for no clipping"),
        (
            "teacher.flow_shift",
            teacher.flow_shift,
            lambda v: v is None or 0 < v < math.inf,
            "positive and finite, or null",
        ),
        ("seed", cfg.seed, lambda v: 0 <= v < 2**63, "in [0, 2**63)"),
        # WanPipeline, which draws the teacher's samples, latents and evaluation, runs CFG only where the (first)
        # scale is above 1: below 1 the targets would be guided at it and every sample drawn without it.
        ("teacher.guidance_scale", teacher.guidance_scale, lambda v: 1 <= v < math.inf, NO_CFG_BELOW_1),
        ("teacher.guidance_scale_2", teacher.guidance_scale_2, lambda v: v is None or 1 <= v < math.inf, SECOND_SCALE),
        ("trainer.schedule_steps", t.schedule_steps, lambda v: v is None or v > 0, SCHEDULE_STEPS),
        # Ranks wait this long for the slowest at a collective, a teacher's loading included: under a minute, a
        # worker failed with torch's traceback and no key named (an audit's 0.0001)
        ("distributed.timeout_min", cfg.distributed.timeout_min, lambda v: v >= 1, "at least 1 (minutes)"),
    ]
    hardware = hardware_problem(cfg.hardware)  # each hardware.* number's range (config.HARDWARE_RANGES)
    if hardware:
        raise UserError(hardware)
    for key, value, ok, what in checks:
        if not ok(value) or (isinstance(value, float) and math.isnan(value)):
            raise UserError(f"{key}={value} must be {what}")
    for key in ("guidance_scale", "guidance_scale_2"):  # legal, and likely a slip (1e9 for 9): the targets saturate
        scale = teacher.get(key)
        if scale is not None and scale > HIGH_CFG:
            log.warning(
                f"teacher.{key}={scale} is far above the 3-7 Wan's pipelines guide with (5 by default): the "
                "teacher's targets and samples will be oversaturated; was a smaller scale meant?"
            )
    if d.val_fraction == 0 and d.get("val_prompts_path") is None:  # split_prompts holds out one all the same
        log.warning(
            "data.val_fraction=0 holds out one prompt all the same (validation and the evaluation need one); "
            "data.val_prompts_path names held-out prompts of your own"
        )
    if teacher.guidance_scale == 1 and teacher.guidance_scale_2 not in (None, 1):
        raise UserError(
            f"teacher.guidance_scale_2={teacher.guidance_scale_2} with teacher.guidance_scale=1: WanPipeline runs CFG "
            "only where teacher.guidance_scale is above 1, so the low-noise expert's samples would be drawn without "
            "it; raise teacher.guidance_scale, or set teacher.guidance_scale_2=1"
        )


RECIPE = ("setup", "train")  # what job/run.py's run_recipe calls on the recipe it builds
# A CFG scale above which a warning asks whether it was meant: Wan guides with 3-7, few go past 15.
HIGH_CFG = 20
NO_CFG_BELOW_1 = "a finite number of 1 or more (1: no CFG; WanPipeline ignores a scale below 1)"
HELD_OUT = "in [0, 1): the share of prompts held out, at least one (e.g. 0.1); data.val_prompts_path names them instead"
SECOND_SCALE = "a finite number of 1 or more (the low-noise expert's CFG scale), or null for teacher.guidance_scale"
SCHEDULE_STEPS = "a positive integer (the LR schedule's length), or null for trainer.max_steps"
MAX_LATENT = 1024  # latent frames/rows/columns: Wan's 720p x 81 frames is 21 x 90 x 160


def check_second_scale(teacher: DictConfig, experts: int) -> None:
    """`teacher.guidance_scale_2` scales a two-expert teacher's low-noise expert: on one expert it would be ignored
    without a word (a two-expert teacher's config pointed at a one-expert folder, say)."""
    if experts == 1 and teacher.get("guidance_scale_2") is not None:
        raise UserError(
            f"teacher.guidance_scale_2={teacher.guidance_scale_2} is the low-noise (second) expert's CFG scale, and "
            f"the teacher {teacher.path} has one expert; drop it with teacher.guidance_scale_2=null (its scale is "
            "teacher.guidance_scale)"
        )


def check_training_parts(cfg: DictConfig) -> tuple[Method, Loss]:
    """The optimizer and LR schedule built once on a one-number parameter: their own argument checks
    (torch's "Invalid learning rate", a schedule's missing option) run now, not after the teacher loads.
    Returns the method, built (the one the run trains with: preflight hands it down in `Prepared`) and
    `trainer.loss` as the run builds it (`recipe.losses.as_loss`), which the later checks read."""
    from diffusers.optimization import get_scheduler

    t = cfg.trainer
    check_numbers_by_signature(t.optimizer, "trainer.optimizer")  # the one callable node no schema types
    lr = t.optimizer.get("lr") if isinstance(t.optimizer, DictConfig) else None
    if isinstance(lr, (int, float)) and not (math.isfinite(lr) and lr <= MAX_LR):  # negative: torch says
        raise UserError(f"trainer.optimizer.lr={lr} must be a finite number in [0, {MAX_LR:g}]; use e.g. 1e-4")
    try:
        optimizer = instantiate(t.optimizer)([torch.nn.Parameter(torch.zeros(1))])
    except (ValueError, TypeError, RuntimeError) as e:
        raise UserError(f"trainer.optimizer: {_first_line(e)}; fix the value under trainer.optimizer") from None
    try:
        get_scheduler(str(t.lr_scheduler), optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=t.max_steps)
    except (ValueError, TypeError) as e:
        raise UserError(f"trainer.lr_scheduler={t.lr_scheduler}: {_first_line(e)}; pick another schedule") from None
    length = t.get("schedule_steps") or t.max_steps
    if str(t.lr_scheduler) == "polynomial" and t.warmup_steps == length:  # its decay would divide by 0 steps
        raise UserError(
            f"trainer.warmup_steps={t.warmup_steps} equals the {length}-step schedule, which diffusers' polynomial "
            f"decay cannot take (it decays over the steps after the warm-up: none); shorten the warm-up (e.g. "
            f"trainer.warmup_steps={length // 10})"
        )
    warn_of_a_still_student(t, lr)
    loss = as_loss(instantiate(t.loss))  # a loss class checks its keys as it is built (Blend's alpha, hidden_kd_weight)
    for node in cfg.hooks.values():  # and each hook its settings (hooks.monitor.val_every=-1), then against the run's
        hook = built_quietly(node)
        if isinstance(hook, Hook):
            hook.check(cfg)
    return built_quietly(cfg.method), loss  # and the method its keys (method.steps=0, a fake score it has not built)


def warn_of_a_still_student(t: DictConfig, lr) -> None:
    """Legal settings under which the student barely moves, each said once (an audit's: a warm-up of 1e9 steps
    completed a run whose loss never moved, without a word)."""
    if lr == 0:
        log.warning("trainer.optimizer.lr=0: the student's weights never change; was a learning rate meant (1e-4)?")
    length = t.get("schedule_steps") or t.max_steps
    warmup = t.warmup_steps if isinstance(t.warmup_steps, int) and str(t.lr_scheduler) != "constant" else 0
    # Past 10x the schedule: its LR stays under a tenth of the asked one. A warm-up as long as the schedule never
    # reaches the asked LR either: said where it is not a short try of the default warm-up of 10 steps
    # (trainer.max_steps=3 still reaches 30%: not worth a line).
    if warmup > 10 * length > 0:
        log.warning(
            f"trainer.warmup_steps={warmup} spans the whole {length}-step schedule: the LR never reaches "
            f"a tenth of trainer.optimizer.lr (at most {length / warmup:.2g} of it); shorten the warm-up"
        )
    elif warmup >= length > 10:
        log.warning(
            f"trainer.warmup_steps={warmup} is as long as the whole {length}-step schedule: the LR only climbs, "
            f"reaching {(length - 1) / warmup:.0%} of trainer.optimizer.lr at its last step and never decaying; "
            f"shorten the warm-up (e.g. trainer.warmup_steps={max(1, length // 10)})"
        )


def check_numbers_by_signature(node, prefix: str) -> None:
    """A `_target_` node no schema types (the optimizer: any torch.optim class, `_partial_`): each key whose
    parameter defaults to a number (or a list of them) must be one, named with its key and type, as a schema's
    key is. Else `trainer.optimizer.lr=1e-3x` reached torch's `0.0 <= lr` as a string and said only
    "'<=' not supported between instances of 'float' and 'str'"."""

    if not isinstance(node, DictConfig) or "_target_" not in node:
        return
    try:
        parameters = inspect.signature(get_method(node._target_)).parameters
    except (ImportError, ValueError, TypeError, AttributeError):  # not importable: instantiating it says so
        return
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    for key in map(str, node):
        parameter = parameters.get(key)
        default = parameter.default if parameter is not None else inspect.Parameter.empty
        value = node[key]
        if number(default) and not number(value):
            what = "a number"
        elif isinstance(default, (tuple, list)) and default and all(number(d) for d in default):
            items = list(value) if isinstance(value, (ListConfig, tuple, list)) else None
            if items is not None and len(items) == len(default) and all(number(v) for v in items):
                continue
            what = f"a list of {len(default)} numbers"
        else:
            continue
        example = list(default) if isinstance(default, tuple) else default
        raise UserError(
            f"{prefix}.{key}={value!r} must be {what} ({node._target_}'s {key}); e.g. {prefix}.{key}={example}"
        )


def built_quietly(node):
    """`instantiate(node)`, a UserError its constructor raised as that one line (Hydra wraps it)."""
    try:
        return instantiate(node)
    except InstantiationException as e:
        if isinstance(e.__cause__, UserError):
            raise e.__cause__ from None
        raise


def method_passes(cfg, method: Method | None = None) -> Passes:
    """What the run's method (built from `cfg.method` where not given) runs in one optimizer step, at the
    trainer's micro-batches and teacher batching: what the planner times and sizes."""
    method = method if method is not None else built_quietly(cfg.method)
    return method.passes(cfg.trainer.grad_accum_steps, cfg.trainer.teacher_whole_step)


MAX_LR = 10.0  # far above any learning rate that trains a transformer: a larger one is a typo (1e4 for 1e-4)


def _first_line(error: Exception) -> str:
    words = str(error).strip().splitlines()
    return words[0] if words else type(error).__name__


FOLDER_KEYS = {  # and an example of each
    "hydra.run.dir": "outputs/my_run",
    "hydra.sweep.dir": "multirun/my_sweep",
    "paths.output_dir": "outputs/my_run",
    "paths.cache_dir": "~/.cache/wandistiller",
    # the data's folders: empty, each read the current directory (a video folder's refusal then spoke of its files)
    "data.root": "/data/my_clips",
    "data.dataset": "/data/my_hf_dataset",
    "teacher.path": "/models/Wan2.1-T2V-1.3B-Diffusers",
}


def check_folders(cfg: DictConfig) -> None:
    """The run folder and the cache can be created and written: checked before either is touched."""

    # The cache's folder from the environment (the default reads WANDISTILLER_CACHE) is named as the user set it.
    from_env = os.environ.get("WANDISTILLER_CACHE") == str(cfg.paths.cache_dir)
    cache_key = "WANDISTILLER_CACHE (paths.cache_dir)" if from_env else "paths.cache_dir"
    cache_fix = "WANDISTILLER_CACHE=… (or paths.cache_dir=…)" if from_env else "paths.cache_dir=…"
    for key, named, folder, fix in (
        ("hydra.run.dir", "hydra.run.dir", cfg.paths.output_dir, "hydra.run.dir=…"),
        ("paths.cache_dir", cache_key, cfg.paths.cache_dir, cache_fix),
    ):
        if not str(folder).strip():  # Path("") is the current directory: a run among whatever that holds
            raise UserError(f"{named} is empty; give it a folder, e.g. {fix.replace('…', FOLDER_KEYS[key])}")
        problem = folder_problem(Path(str(folder)))
        if problem:
            raise UserError(f"{named}: {problem}; choose another folder with {fix}")
    cache = Path(str(cfg.paths.cache_dir)).expanduser()
    run = run_holding(cache)
    if run is not None and run.resolve() != Path(str(cfg.paths.output_dir)).expanduser().resolve():  # its own: ok
        raise UserError(
            f"{cache_key}: it is or lies in the run folder {run}, whose files are that run's; choose another "
            f"folder with {cache_fix}"
        )


def check_tracker(cfg: DictConfig) -> None:
    """Each logger's own refusals (`check`, e.g. logger.wandb.mode=online needs a wandb key), without the network;
    an entry of `logger` that is not a logger is one line listing the shipped ones."""

    for key, node in cfg.logger.items():
        if not isinstance(node, DictConfig) or "_target_" not in node:
            names = ", ".join(conf_options("logger"))
            raise UserError(
                f"logger.{key}={node!r} is not a logger; `logger` names loggers ({names}), each with its keys under "
                "its name: e.g. logger=[wandb,csv] logger.wandb.mode=online"
            )
        check = getattr(get_object(node._target_), "check", None)  # a logger of your own need not have one
        if callable(check):
            check(node, f"logger.{key}")


def drop_settings_of_unlisted_hooks(cfg: DictConfig) -> DictConfig:
    """The `hooks` list decides which hooks run: an experiment's settings of a hook the list leaves out
    (`+experiment=pocket_fewstep hooks=[monitor,progress]`: its `hooks.evaluate.limit`) go with that hook, as the
    docs say, rather than stand as an entry that is no hook. A setting given on the command line of a hook the list
    leaves out is refused at composition (core/hydra.py's hydra_error_line)."""
    shipped = set(conf_options("hooks"))
    unlisted = [k for k, v in cfg.hooks.items() if k in shipped and isinstance(v, DictConfig) and "_target_" not in v]
    if unlisted:
        with open_dict(cfg.hooks):
            for key in unlisted:
                del cfg.hooks[key]
    return cfg


def check_hooks(cfg: DictConfig) -> None:
    """An entry of `hooks` that is not a hook (`+hooks.mine.every=5` with no `_target_`) is one line (the hooks are
    built once by check_training_parts, so their own settings' refusals come before anything heavy)."""

    for key, node in cfg.hooks.items():
        if not isinstance(node, DictConfig) or "_target_" not in node:
            names = ", ".join(conf_options("hooks"))
            raise UserError(
                f"hooks.{key}={node!r} is not a hook; `hooks` names hooks ({names}), each with its keys under its "
                f"name: e.g. hooks=[monitor,progress], or +hooks.{key}._target_=my_package.MyHook for your own"
            )


def check_targets(cfg: DictConfig) -> None:
    """Every `_target_` a user may swap names something importable, before anything else runs."""

    listed = [
        f"{group}.{k}"
        for group in ("logger", "hooks")
        for k, v in cfg[group].items()
        if isinstance(v, DictConfig) and "_target_" in v
    ]
    for key in ("recipe", "student", "trainer.loss", "trainer.optimizer", *listed, "teacher_placement", "method"):
        target = OmegaConf.select(cfg, f"{key}._target_")
        try:
            with quieted("hydra.utils", logging.CRITICAL):  # it logs three lines of its own before raising: ours is one
                found = get_object(target)
        except Exception:  # ImportError, AttributeError, ValueError: all "cannot find it"
            raise UserError(
                f"{key}._target_={target!r} cannot be imported; name a class or function as module.name (on PYTHONPATH)"
            ) from None
        if key == "recipe" and not (isinstance(found, type) and all(callable(getattr(found, m, None)) for m in RECIPE)):
            raise UserError(  # else an internal error once the run folder was made: `print(...)` has no setup()
                f"recipe._target_={target!r} is not a recipe (a class with setup() and train()); name a subclass of "
                "DistillationRecipe (in wandistiller/recipe/distillation.py)"
            )

    check_signatures(cfg)


def check_missing(cfg: DictConfig) -> None:
    """Every key of the schema is there and has a value: `~trainer` leaves the schema's mandatory `???`
    behind and `~seed` removes the key, each an internal error once the run folder was made."""

    def absent(schema, node: DictConfig, prefix: str):  # fields of the schema an override deleted (~seed)
        for field in dataclasses.fields(schema):
            sub = _schema_of(schema, field.name)
            if field.name not in node:
                yield prefix + field.name
            elif sub is not None and isinstance(node[field.name], DictConfig):
                yield from absent(sub, node[field.name], f"{prefix}{field.name}.")

    unset = [key for key, raw in _leaves(OmegaConf.to_container(cfg, resolve=False), "") if raw == "???"]
    missing = list(dict.fromkeys([*absent(TrainConfig, cfg, ""), *unset]))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        group = missing[0].split(".")[0]
        raise UserError(
            f"{missing[0]} has no value{more}: an override removed it (~{group}?); drop the ~ override "
            f"or give {missing[0]}=…"
        )


def check_interpolations(cfg: DictConfig) -> None:
    """Every `${…}` resolves (an unset environment variable, a key that does not exist): one line naming
    the key that holds the bad one (not a key that merely refers to it), before any value is used."""

    check_missing(cfg)
    failing = []
    for key, raw in _leaves(OmegaConf.to_container(cfg, resolve=False), ""):
        if isinstance(raw, str) and "${" in raw:
            try:
                OmegaConf.select(cfg, key, throw_on_missing=False)
            except OmegaConfBaseException as e:
                failing.append((key, raw, str(getattr(e, "msg", e)).strip().splitlines()[0]))
    if failing:
        names = re.findall(r"'([^']+)'", failing[0][2])  # the variable or key it could not find
        key, raw, message = next((f for f in failing if any(n in f[1] for n in names)), failing[0])
        raise UserError(f"{key}={raw}: {message}; fix the interpolation (or set the variable it reads)")


def _leaves(node, prefix: str):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{prefix}[{i}]" if prefix else str(i))
    else:
        yield prefix, node
