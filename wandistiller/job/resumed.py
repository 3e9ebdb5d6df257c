"""The config a resumed run continues with: the run's own saved `.hydra/config.yaml`, not the defaults.

`trainer.resume=auto` into a folder that holds a saved config continues *that* run. Keys given again on
the command line must agree with it, except the keys a resume may change (how long to train, how to log,
where the teacher and its LoRAs lie: their content is held to the checkpoint's, ...); any other disagreement is
refused in one line that lists them all. A key not given again keeps the saved value, so `hydra.run.dir=…
trainer.resume=auto` alone continues the run as it was started (a 1000-step run resumed without its overrides does
not stop at the default's step count).

Nothing given is dropped without a word: a key given is taken (a hook removed with `~hooks.x` is removed) or
refused; a group of whole-tree settings (`+experiment=…`, `debug=fast`) is held to the run by every key it sets.
Another `trainer.max_steps` keeps the run's LR schedule (`trainer.schedule_steps`, its first launch's length): a
shorter one stops earlier along it, a longer one trains on at its last LR (said in the line that continues it).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, cast

import torch
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from wandistiller.config import CONF_DIR, TrainConfig
from wandistiller.core.errors import UserError
from wandistiller.core.files import in_run
from wandistiller.core.hydra import compose_option, compose_tree, experiment_in_place
from wandistiller.job.checks import check_interpolations, check_missing, name_the_teacher
from wandistiller.recipe.distillation import ENDLESS_SCHEDULES
from wandistiller.state.checkpoint import list_checkpoints, recorded_method, records_teacher, resume_candidate
from wandistiller.state.received import check_received, load_yaml_config, targets_of
from wandistiller.state.runs import NAMED_BY_PATH, PLACES, latest_places, put_places
from wandistiller.student.lora import is_lora

log = logging.getLogger("wandistiller")

# Keys (and whole subtrees) a resume may change: they do not change what the student learns (trainer.max_steps:
# where it stops, along the LR schedule the run was made with; `_keep_schedule`).
MAY_CHANGE = (
    "trainer.max_steps",
    "trainer.resume",
    "trainer.allow_other_teacher",
    "trainer.log_every",
    "trainer.progress_bar",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.gradient_checkpointing",
    "trainer.compile_student",
    "trainer.teacher_whole_step",
    "teacher.compile",
    "teacher_placement",
    "logger",
    "hooks",
    "hydra",
    "paths.cache_dir",  # derived files only (built tiny teachers, text embeddings)
    "hardware",
    "distributed.timeout_min",
    "distributed.rdzv_endpoint",
    "distributed.rdzv_id",
)
# PLACES (state/runs.py), where the teacher and its LoRAs lie, not what they are: taken where the checkpoint resumed
# records its teacher, since preflight's `check_teacher` then holds what is found at the new place to that record
# (shape, the weights' digest, each LoRA's sha256, strength and experts); refused like any other key where nothing
# would hold it (no checkpoint). Once taken, later resumes and tools find them there (`latest_places`).
# Always this launch's: the folder is the one being resumed (its saved value is `${hydra:…}` of the first job),
# and the cache is this machine's (a folder sent from elsewhere never writes into the cache its sender named).
# A saved config never allows another teacher on its own: only this command line does.
ALWAYS_CURRENT = ("paths.output_dir", "paths.cache_dir", "trainer.resume", "trainer.allow_other_teacher")
# Where a run's data lies: no checkpoint records what the data was, so a new place cannot be held to it and is
# refused, naming the link that lets the resume read it where it is now.
DATA_PLACES = ("data.root", "data.dataset")
_continuing: dict[Path, str] = {}  # run folder -> what continued_config took from this command line, until said


def may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in MAY_CHANGE)


def task_overrides() -> list[str] | None:
    """This job's command-line overrides (Hydra's), or None outside a Hydra job (a composed config)."""

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None


def recorded_overrides(run_dir: Path, resume: str | None, with_now: bool = True) -> list[str] | None:
    """The overrides that made this run: a resume's added after the first run's (.hydra/overrides.yaml); the first
    run's alone without `with_now`."""
    now = task_overrides() if with_now else None
    first_file = in_run(run_dir, ".hydra/overrides.yaml")
    first = []
    if resume == "auto" and first_file.is_file():
        try:
            loaded = OmegaConf.to_container(load_yaml_config(first_file, "saved overrides list"))
            first = [str(o) for o in loaded] if isinstance(loaded, list) else []
        except (OmegaConfBaseException, yaml.YAMLError, ValueError, OSError, UserError):
            first = []
    if now is None and not first:
        return None
    first = experiment_in_place(first)  # a run saved before wrote `+experiment=`
    return first + [o for o in experiment_in_place(now or []) if o not in first]


def trained_method(run_dir: Path, resume: str | None) -> str | None:
    """The `method=` the run a `trainer.resume` continues was trained with, as it saved it: its checkpoint's record,
    else the saved config of the run folder it lies in (`resume=auto`: `run_dir`); None where neither says. Only
    read, never trusted further than its name (a command line's hint: `compose.check_overrides`)."""

    if not resume:
        return None
    checkpoint = resume_candidate(resume, run_dir)
    recorded = recorded_method(checkpoint) if checkpoint is not None else None
    if recorded is not None:
        return recorded["name"]
    folder = run_dir if resume == "auto" else checkpoint.parent.parent if checkpoint else Path(resume).expanduser()
    try:
        name = OmegaConf.select(load_yaml_config(in_run(folder, ".hydra/config.yaml")), "method.name")
    except (OmegaConfBaseException, yaml.YAMLError, ValueError, OSError, UserError):
        return None
    return name if isinstance(name, str) and name.isidentifier() else None


def saved_config(run_dir: Path, trusted: set[str] | frozenset[str] = frozenset()) -> DictConfig | None:
    """The run's first config (.hydra/config.yaml), or None when the folder holds none. It is data (the
    folder may have come from someone else): checked against the schema and the allowed `_target_`s
    (the project's, and `trusted`: this command line's) before anything in it is used."""
    path = in_run(run_dir, ".hydra/config.yaml")  # a received folder's link to a file elsewhere is refused
    if not path.is_file():
        return None
    try:
        saved = load_yaml_config(path)  # its size and aliases bounded first
    except UserError as e:
        saved = str(e).removeprefix(f"{path} ").split("; restore")[0]
    except (OmegaConfBaseException, yaml.YAMLError, ValueError, OSError) as e:
        saved = f"cannot be read ({type(e).__name__})"
    if not isinstance(saved, DictConfig) or "trainer" not in saved:
        raise UserError(
            f"trainer.resume=auto: {path} is damaged ({saved if isinstance(saved, str) else 'not a saved config'}); "
            "restore it, or continue with this command line's config via trainer.resume=<checkpoint folder>"
        )
    check_received(saved, path, trusted, hint="give {key}={target} on this command line")
    return saved


def continued_config(cfg: DictConfig, overrides: list[str] | None) -> DictConfig:
    """`cfg` itself for a new run; for `trainer.resume=auto` into a run with a saved config, that config
    with only the keys a resume may change taken from `cfg` (all of them, or those in `overrides`)."""
    try:  # an earlier call's, in this process, for this folder: not this one's
        _continuing.pop(_key(cfg), None)
    except (OmegaConfBaseException, ValueError):  # a folder not named yet (outside a Hydra job): none was kept
        pass
    if cfg.trainer.resume != "auto":
        return cfg
    name_the_teacher(cfg)  # as the saved config was named (prepare names it): teacher.name then agrees
    run_dir = Path(str(cfg.paths.output_dir))
    saved = saved_config(run_dir, targets_of(cfg))
    if saved is None and list_checkpoints(run_dir):  # composed anew, it would be another run's config, unsaid
        raise UserError(
            f"trainer.resume=auto: {run_dir} holds checkpoints but no .hydra/config.yaml, the config they were "
            "trained with; restore it, or continue them with this command line's whole config via "
            f"trainer.resume={list_checkpoints(run_dir)[-1]} hydra.run.dir=<a new folder>"
        )
    if saved is None:
        return cfg
    before_methods = with_method_of_before(saved)
    recorded = functools.cache(lambda: _teacher_recorded(run_dir))  # the checkpoints read once, where needed
    moved_since = _moved_since(saved, run_dir, recorded)
    given = _given_keys(overrides) if overrides is not None else None
    typed = set(given or ())  # the keys this command line names itself
    wholes = _whole_tree_choices(overrides, cfg) if overrides is not None else {}
    first = set(recorded_overrides(run_dir, "auto", with_now=False) or [])
    wholes = {line: keys for line, keys in wholes.items() if line not in first}  # the first launch's, restated
    for keys in wholes.values():  # `+experiment=x`: held to the run, or taken, key by key as if each were given
        given = (given or set()) | keys
    now, before = _flat(cfg), _flat(saved)
    # A key the schema gained since the run was saved (data.fps), at its off value, is how the run trained: the same.
    before |= {k: None for k, v in now.items() if v is None and k not in before}
    # A whole composed config is held to the run key by key, its schedule's length aside: always the run's own.
    asked = given if given is not None else {k for k in now.keys() | before.keys() if not may_change(k)} - {SCHEDULE}
    if given is None and now.get("precision.name") == "auto":  # a whole config (in-process): auto is the run's own
        asked = {k for k in asked if not k.startswith("precision.")}  # resolved choice, saved as its dtypes
    # A group given again as the run chose it (`method=dmd` on a dmd run) restates the choice, not its defaults:
    # its keys keep the saved values, each held to the command line only where given (`method.fake_updates=3`).
    asked = {k for k in asked if not (given is not None and _same_choice(now, before, k))}
    places = set(PLACES) if _new_places_held(now, before, recorded) else set()
    # A teacher an `+experiment=x` chooses is that experiment's, another run's: not the run's own found elsewhere.
    places -= {k for keys in wholes.values() for k in keys if k not in typed}
    # A teacher found in another folder is named by that folder, as its first launch was (`name_the_teacher`).
    moved = "teacher.path" in places and (given is None or "teacher.path" in given)
    moved = moved and now.get("teacher.path") != before.get("teacher.path")
    follows = set(NAMED_BY_PATH) if moved else set()
    current = lambda k: may_change(k) or k in ALWAYS_CURRENT or k in places or k in follows
    differ = sorted(k for k in asked if not current(k) and _subtree(now, k) != _subtree(before, k))
    if differ:
        _refuse_changes(cfg, now, before, differ, wholes)
    # Exactly the keys given (logger.wandb.mode alone keeps the saved logger.wandb.project), or every changeable one.
    taken = set(MAY_CHANGE) | places if given is None else {g for g in given if may_change(g) or g in places}
    taken |= follows
    result = saved.copy()
    for key in sorted(taken | set(ALWAYS_CURRENT)):
        _put(result, key, cfg, now)

    schedule_note = _keep_schedule(result, saved)
    merged = cast(DictConfig, OmegaConf.merge(OmegaConf.structured(TrainConfig), result))  # a DictConfig merged in
    OmegaConf.set_struct(merged, True)
    saved_file = Path(str(cfg.paths.output_dir)) / ".hydra" / "config.yaml"
    try:  # a key the schema needs and the saved file lacks: what it says, not an override nobody gave (~teacher)
        check_missing(merged)
    except UserError as e:
        key = str(e).split(" ", 1)[0]
        raise UserError(
            f"{saved_file} has no {key}: the run's saved config is damaged; restore it, or start a new run with "
            "hydra.run.dir=<a new folder>"
        ) from None
    try:  # the saved `${…}`s, resolved now against the schema's types (a string where a number goes)
        check_interpolations(merged)
    except UserError as e:
        raise UserError(f"{e} (in {saved_file})") from None
    # Said once preflight accepts the resume (`continuing`): a refused one appends nothing to the run's train.log.
    _continuing[_key(cfg)] = (
        (f" and {sorted(taken)}" if taken else "")
        + (
            f" (saved before the `method` group: it trained as method={BEFORE_METHODS}, and continues so)"
            if before_methods
            else ""
        )
        + schedule_note
        + (f" (the teacher where {moved_since.name} found it)" if moved_since and "teacher.path" not in taken else "")
    )
    return merged


def _moved_since(saved: DictConfig, run_dir: Path, recorded: Callable[[], bool]) -> Path | None:
    """The teacher's places (`saved`'s, replaced) as the run's newest resume took them (`latest_places`), where the
    checkpoint resumed records its teacher: preflight's `check_teacher` holds them to that record again, as it held
    them when that resume took them. Returns the resume config they came from, else None."""
    latest = latest_places(run_dir, saved)
    if latest is None or not recorded():
        return None
    put_places(saved, latest[1])
    return latest[0]


def _new_places_held(now: dict, before: dict, recorded: Callable[[], bool]) -> bool:
    """Whether this command line puts the teacher or its LoRAs at a new place (`PLACES`) that the checkpoint it
    resumes can hold (it records its teacher); the checkpoints are looked at only where a place changed."""
    if all(_subtree(now, k) == _subtree(before, k) for k in PLACES):
        return False
    return recorded()


def _teacher_recorded(run_dir: Path) -> bool:
    """Whether the checkpoint a resume of `run_dir` continues records its teacher (to hold a new place to)."""
    found = resume_candidate("auto", run_dir)
    return found is not None and records_teacher(found)


def _refuse_changes(cfg: DictConfig, now: dict, before: dict, differ: list[str], wholes: dict) -> NoReturn:
    """One line naming what would change what the run trains: the command line's own words where a whole config
    reaches those keys (an experiment as `experiment=x`, the spelling both `+experiment=x` and it are read as), else
    the keys and both values."""
    shown = list(dict.fromkeys(d for k in differ for d in _differences(now, before, k)))  # each once, in order
    named = [f"{line} (it sets {_said(now, before, [k for k in differ if k in keys])})"
             for line, keys in wholes.items() if any(k in keys for k in differ)]  # fmt: skip
    if named:  # what the user typed, not the keys it reaches
        raise UserError(
            f"trainer.resume=auto continues the run in {cfg.paths.output_dir} with its saved config, and "
            f"{'; '.join(named)[:600]} would change what it trains; drop it to continue the run, or start a new "
            "run with hydra.run.dir=<a new folder>"
        )
    moved = [k for k in differ if k in PLACES]
    why = (  # a new place is taken only where a checkpoint's record of the teacher holds it (PLACES)
        f" ({' and '.join(moved)} at a new place: no checkpoint in it records the teacher to hold it to; put the "
        "files back where the run had them)"
        if moved
        else ""
    )
    same_source = now.get("data.latents") == before.get("data.latents")  # the data group's own choice key
    data = [k for k in differ if k in DATA_PLACES and k in before and k in now and same_source]
    if data and not moved:  # no checkpoint records the data, so its new place is refused even beside a checkpoint
        was, now_at = _show(before, data[0]), _show(now, data[0])
        why = (
            f" (a resume reads the run's data where the run had it; if it moved, put it back or link the old place "
            f"to the new: ln -s {now_at} {was})"
        )
    raise UserError(
        f"trainer.resume=auto continues the run in {cfg.paths.output_dir} with its saved config, and "
        f"{', '.join(shown[:8])}{' …' if len(shown) > 8 else ''} disagree{why}; drop them to continue it, or start "
        "a new run with hydra.run.dir=…"
    )


# What a pre-release run without a `method` node trained with: its one training step is method=kd's, bit for bit.
BEFORE_METHODS = "kd"


def with_method_of_before(saved: DictConfig) -> bool:
    """A pre-release config without a `method` node gets the method it trained with (`method=kd`, composed with its
    schema), so its resume continues it as it was, not refused as "method has no value: ... (~method?)", which no
    one wrote. True where one was added."""
    if "method" in saved:
        return False
    kd = OmegaConf.to_container(compose_option("method", BEFORE_METHODS), resolve=False)
    with open_dict(saved):
        saved["method"] = kd
    return True


def continuing(run_dir: Path) -> None:
    """The line that a resume continues the run's saved config (what `continued_config` took for it), said
    once the resume is accepted; nothing for a run that does not continue a saved config."""
    taken = _continuing.pop(Path(run_dir).resolve(), None)
    if taken is not None:
        log.info("trainer.resume=auto: continuing with the run's saved config%s", taken)


def _key(cfg: DictConfig) -> Path:
    return Path(str(cfg.paths.output_dir)).resolve()


def _given_keys(overrides: list[str]) -> set[str]:
    """The config keys (or groups) an override list sets; `hydra.*` included, so it may change."""

    return {o.key_or_group for o in OverridesParser.create().parse_overrides(overrides)}


SCHEDULE = "trainer.schedule_steps"  # a resume's is its first launch's (`_keep_schedule`); given again, held to it


def _keep_schedule(result: DictConfig, saved: DictConfig) -> str:
    """The LR schedule the run was made with: its length (`trainer.schedule_steps`) is the first launch's, whatever
    `trainer.max_steps` this resume gives, so the LR at every step is the one the run was made with (never a jump to
    another curve). Steps past its length train at the LR it ends at (recipe/distillation.py): the note names it
    (cosine's 0, or a warm-up's share), and how to train on at a real LR."""
    horizon = OmegaConf.select(saved, "trainer.schedule_steps") or OmegaConf.select(saved, "trainer.max_steps")
    if not isinstance(horizon, int):
        return ""
    OmegaConf.update(result, "trainer.schedule_steps", horizon, force_add=True)
    steps = OmegaConf.select(result, "trainer.max_steps")
    schedule = str(OmegaConf.select(result, "trainer.lr_scheduler"))
    if not isinstance(steps, int) or steps <= horizon or schedule in ENDLESS_SCHEDULES:
        return ""
    past = _steps(horizon + 1, steps) + (" trains" if steps == horizon + 1 else " train")
    # The LR it is held at, computed as the run computes it (a newcomer's: "at its last LR" hid that a cosine run
    # extended trained at 0; a warm-up as long as the schedule holds another LR than any step used).
    lr = OmegaConf.select(result, "trainer.optimizer.lr")
    share = _held_share(schedule, OmegaConf.select(result, "trainer.warmup_steps") or 0, horizon, lr)
    if share is None:
        last = "at its last LR"
    elif share == 0:  # cosine's and linear's end
        last = "at LR 0, where it ends: they change nothing"
    else:
        part = f"{share:.0%}" if share >= 0.01 else f"{share * 100:.2g}%"
        value = f"LR {share * lr:.3g} ({part} of trainer.optimizer.lr)" if isinstance(lr, (int, float)) else ""
        last = f"at {value or f'{part} of trainer.optimizer.lr'}, where it ends"
    said = (
        f"; trainer.max_steps={steps} goes past the run's {schedule} LR schedule of {horizon} steps (kept as the run "
        f"was made), so {past} {last}"
    )
    if share is not None and share >= 1:  # held at the full LR: nothing lost
        return said
    if is_lora(OmegaConf.select(result, "student")):  # adapters start from nothing else: no student.init
        return said + f"; to train on at a real LR, start a new run of the whole length (trainer.max_steps={steps})"
    return (
        f"{said}; to train on at a real LR, start a new run from its student: "
        f"student.init={result.paths.output_dir}/student hydra.run.dir=<a new folder>"
    )


def _held_share(schedule: str, warmup: int, horizon: int, lr) -> float | None:
    """The share of the LR a run's schedule holds past its end (recipe/distillation.py `held_after`): diffusers'
    factor at `horizon`, for the run's `lr` (polynomial ends at an absolute lr_end); None where it cannot be
    computed here (an unknown schedule)."""
    from diffusers.optimization import get_scheduler

    try:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=float(lr) if lr else 1.0)
        factor = get_scheduler(schedule, optimizer, num_warmup_steps=warmup, num_training_steps=horizon)
        return float(factor.lr_lambdas[0](horizon)) if hasattr(factor, "lr_lambdas") else None
    except Exception:  # diffusers raises several types for a schedule it cannot build without more settings
        return None


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _whole_tree_choices(overrides: list[str], cfg: DictConfig) -> dict[str, set[str]]:
    """Each override of a group that sets keys across the tree (`+experiment=pocket_fewstep`, `debug=fast`: a
    `@package _global_` option, no node of its own), mapped to the keys it sets: those where the default tree
    composed with it differs from the default tree. A resume holds the run to each of them, never drops them."""
    out: dict[str, set[str]] = {}
    parsed = OverridesParser.create().parse_overrides(experiment_in_place(overrides))
    lines = [str(o.input_line) for o in parsed if _whole_tree(o, cfg)]
    if not lines:
        return out
    base = _flat(compose_tree("train", []))
    for line in lines:
        unset = object()
        chosen = _flat(compose_tree("train", [line]))
        out[line] = {k for k in base.keys() | chosen.keys() if base.get(k, unset) != chosen.get(k, unset)}
    return out


def _whole_tree(override, cfg: DictConfig) -> bool:
    key = override.key_or_group
    return (
        override.input_line is not None
        and not override.is_delete()
        and "." not in key
        and key != "hydra"
        and (key not in cfg)
    )


def _flat(cfg: DictConfig) -> dict[str, object]:
    """Every leaf as dotted-key -> raw value (interpolations unresolved: a saved config cannot resolve
    `${hydra:…}` outside its job)."""
    out: dict[str, object] = {}

    def walk(node, prefix):
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            out[prefix] = node

    walk(OmegaConf.to_container(cfg, resolve=False, enum_to_str=True), "")
    return out


def _subtree(flat: dict, key: str) -> dict:
    return {k: v for k, v in flat.items() if k == key or k.startswith(key + ".")}


def _same_choice(now: dict, before: dict, key: str) -> bool:
    """Whether `key` is a group whose option (its `name`: method, teacher, precision) is the saved one."""
    name = f"{key}.name"
    return name in now and name in before and now[name] == before[name]


# The key a group's options differ by where no `name` or `_target_` does: data's source, student's builder (a data
# source chosen otherwise was six keys "unset (saved …)", data.root=unset (saved None) among them).
CHOICE_KEYS = ("latents", "builder")


def _differences(now: dict, before: dict, key: str) -> list[str]:
    """`key=<now> (saved <before>)` for what differs under `key`: a leaf itself; a group chosen otherwise (its `name`
    or `_target_` differs) as that choice (`method=kd (saved dmd)`); else each of its leaves that differs, not the
    whole subtree (`method.fake_score=student (saved lora)`)."""
    sub_now, sub_before = _subtree(now, key), _subtree(before, key)
    if list(sub_now) in ([key], []) and list(sub_before) in ([key], []):
        return [f"{key}={_show(now, key)} (saved {_show(before, key)})"]
    for field in ("name", "_target_"):
        leaf = f"{key}.{field}"
        if (leaf in sub_now or leaf in sub_before) and sub_now.get(leaf) != sub_before.get(leaf):
            return [f"{key}={_show(now, leaf)} (saved {_show(before, leaf)})"]
    for field in CHOICE_KEYS:  # a group whose choice is a key of its own: that key alone, not every key it brings
        leaf = f"{key}.{field}"
        if leaf in sub_now and leaf in sub_before and sub_now[leaf] != sub_before[leaf]:
            shown = (_show(now, leaf), _show(before, leaf))
            if field == "builder" and all(_is_option(key, v) for v in shown):  # a student option is its builder's name
                return [f"{key}={shown[0]} (saved {shown[1]})"]
            return [f"{leaf}={shown[0]} (saved {shown[1]})"]
    unset = object()
    leaves = sorted(k for k in sub_now.keys() | sub_before.keys() if sub_now.get(k, unset) != sub_before.get(k, unset))
    return [f"{k}={_show(now, k)} (saved {_show(before, k)})" for k in leaves]


def _is_option(group: str, name: str) -> bool:
    """Whether `name` is one of the shipped options of config group `group` (conf/<group>/<name>.yaml)."""
    return (CONF_DIR / group / f"{name}.yaml").is_file()


def _said(now: dict, before: dict, keys: list[str], most: int = 4) -> str:
    """What differs among `keys`, a group chosen otherwise said once as that choice (`method=dmd (saved kd)`)."""
    said: list[str] = []
    for key in keys:
        top = key.split(".")[0]
        whole = _differences(now, before, top)
        said.append(whole[0] if whole and whole[0].startswith(f"{top}=") else _differences(now, before, key)[0])
    said = sorted(dict.fromkeys(said), key=lambda d: "." in d.split("=")[0])  # the choices first
    return ", ".join(said[:most]) + (" …" if len(said) > most else "")


def _show(flat: dict, key: str) -> str:
    sub = _subtree(flat, key)
    if not sub:
        return "unset"
    return (
        str(sub[key])
        if list(sub) == [key]
        else "{" + ", ".join(f"{k[len(key) + 1 :]}: {v}" for k, v in sub.items()) + "}"
    )


def _put(result: DictConfig, key: str, cfg: DictConfig, now: dict) -> None:
    """result[key] = cfg[key], raw, a whole subtree replaced (a placement's keys are not merged into another's). A
    setting of a hook or logger the saved run did not have (`hooks.samples.prompts=0`) brings that whole entry."""
    parts = key.split(".")
    entry = ".".join(parts[:2])
    if parts[0] in ("hooks", "logger") and len(parts) > 2 and (OmegaConf.select(result, entry) is None or not
                                                               _subtree(now, entry)):  # fmt: skip
        key = entry
    sub = _subtree(now, key)
    if not sub:  # removed on this command line (`~hooks.evaluate`, a list without it): removed from the run too
        parent, _, last = key.rpartition(".")
        node = OmegaConf.select(result, parent) if parent else result
        if isinstance(node, DictConfig) and last in node:
            with open_dict(node):
                del node[last]
        return
    node = OmegaConf.select(cfg, key) if list(sub) != [key] else None
    value = OmegaConf.to_container(node, resolve=False, enum_to_str=True) if node is not None else sub[key]
    OmegaConf.update(result, key, value, merge=False, force_add=True)
