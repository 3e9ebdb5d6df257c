"""A finished (or running) run folder, read back: its config, its teacher, a chosen student, and both
sampling through WanPipeline -- the pieces `wandistiller.eval` and `wandistiller.generate` share.

The student is a WanTransformer3DModel, so it drops into WanPipeline in the teacher's place; it was
trained on guided targets, so it samples without CFG (guidance 1). A KD student samples with the teacher's own
scheduler at any step count; a few-step student (`method.steps` = K in its saved config) with its own few-step
scheduler (teacher/fewstep.py), at K steps unless told otherwise.
"""

from __future__ import annotations

import argparse
import copy
import fcntl
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from safetensors.torch import load_file

from wandistiller.core import leftovers
from wandistiller.core.atomic import NO_LOCKS
from wandistiller.core.errors import UserError, clipped, quieted
from wandistiller.core.files import OutsideRunFolder, check_tree, enclosing_run, in_run, opened, overlap, read_json_in
from wandistiller.core.hydra import register_resolvers
from wandistiller.core.precision import cast_keeping_fp32
from wandistiller.core.tensor_files import safetensors_problem
from wandistiller.state.checkpoint import (
    LEGACY_FILE,
    OTHER_TEACHER_FIX,
    STATE_FILE,
    adapters_problem,
    check_compatible,
    checkpoint_dir,
    layout_problem,
    list_checkpoints,
    load_checkpoint,
    refuse_linked_in,
    teacher_digest,
    teacher_problem,
    tensors_digest,
)
from wandistiller.state.checkpoint import (
    problem as checkpoint_problem,
)
from wandistiller.state.received import load_json, load_received, load_yaml_config, local_cache_dir, looks_like_hub_id
from wandistiller.student.lora import WEIGHTS as LORA_WEIGHTS
from wandistiller.student.lora import is_lora, is_lora_folder, merged_experts
from wandistiller.teacher.fewstep import DEFAULT_SCHEDULE, Schedule, few_step_scheduler, parse_schedule
from wandistiller.teacher.finetune import KEY as LORA_KEY
from wandistiller.teacher.finetune import entries, relocated, with_loras
from wandistiller.teacher.model import Teacher
from wandistiller.teacher.spec import TeacherSpec, inspect_teacher, resolve_teacher_path
from wandistiller.teacher.vae import pocket_frames_problem


def student_steps(cfg: DictConfig) -> int | None:
    """A run's student's own step count K (`method.steps` of its config), or None for a KD student: no `method`
    node (a pre-release config), or `method.steps` null. Read as saved, never resolved (the model card
    reads a received config with it); anything but a positive integer or null is one line."""
    method = cfg.get("method") if isinstance(cfg, DictConfig) else None
    if method is None:
        return None
    saved = OmegaConf.to_container(method, resolve=False) if isinstance(method, DictConfig) else method
    if not isinstance(saved, dict):
        raise UserError(f"method={saved!r} in the run's saved config is not a method's settings; restore the config")
    steps = saved.get("steps")
    if steps is None:
        return None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UserError(
            f"method.steps={steps!r} in the run's saved config is not a step count (a whole number, "
            "1 or more; null for a KD student); restore the config"
        )
    return steps


def student_schedule_of(cfg: DictConfig) -> Schedule:
    """A few-step run's schedule (`method.schedule`, `method.shift` of its saved config, as saved; a config from
    before them: diffusers' Euler), checked as the method checks it: a bad one is one line."""
    method = cfg.get("method") if isinstance(cfg, DictConfig) else None
    steps = student_steps(cfg)
    if method is None or steps is None:
        return Schedule()
    saved = OmegaConf.to_container(method, resolve=False) if isinstance(method, DictConfig) else method
    assert isinstance(saved, dict)  # student_steps refused anything else
    return parse_schedule(saved.get("schedule", DEFAULT_SCHEDULE), saved.get("shift"), steps)


def student_scheduler(spec: TeacherSpec, trained_steps: int | None, steps: int, schedule: Schedule | None = None):
    """The scheduler a student samples `steps` steps with: None (the teacher's own, at `steps`) for a KD
    student (`trained_steps` None); a few-step student's Euler scheduler on its schedule (`schedule`: the run's
    `trained_schedule`, default diffusers' own) at `steps`, K or another count."""
    return None if trained_steps is None else few_step_scheduler(spec, steps, schedule)


@dataclass
class RunFolder:
    path: Path
    cfg: DictConfig
    spec: TeacherSpec

    @property
    def trained_steps(self) -> int | None:
        """The student's own step count K (`method.steps`), None for a KD student."""
        return student_steps(self.cfg)

    @property
    def trained_schedule(self) -> Schedule:
        """The sigmas' schedule the few-step student was trained at (`method.schedule`), diffusers' Euler by default."""
        return student_schedule_of(self.cfg)

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        d = self.cfg.data
        # The noise's channels (out_channels): an I2V expert's in_channels also count its mask and image latents.
        return (self.spec.latent_channels, d.latent_frames, d.latent_height, d.latent_width)


def check_out_of_run(out: Path, run_dir: Path) -> None:
    """An export's `--out` (export, pipeline) lies outside the run folder and does not hold it: a run folder holds
    what training writes, and a folder that holds the run would take it with it when replaced."""
    where = overlap(out, run_dir)
    if where == "holds":
        raise UserError(f"--out {out} holds the run folder {run_dir}; choose a folder outside it")
    other = enclosing_run(out)  # another run's too: its resume replaces student/ and prunes checkpoints/, files and all
    if where or other is not None:
        raise UserError(
            f"--out {out} is inside the run folder {run_dir if where else other}; choose a folder outside it (a run "
            "folder holds what training writes)"
        )


def check_out_of_inputs(out: Path, run: RunFolder) -> None:
    """`check_out_of_run`, and `--out` neither is, holds, nor lies in the teacher's folder or one of its LoRAs'
    files, which the export reads: --force replaced the folder it names, and so deleted a teacher (tens of GB of a
    download) given as --out."""
    check_out_of_run(out, run.path)
    here = Path.cwd().resolve()
    if out.expanduser().resolve() in (here, *here.parents):  # renamed aside whole, under the shell that is in it
        raise UserError(
            f"--out {out} is the current folder or holds it (an empty --out is the current folder), which an export "
            "replaces as a whole; choose a new folder, e.g. --out exported"
        )
    teacher = Path(run.spec.path)
    inputs = [("the teacher's folder", teacher)]
    inputs += [("the teacher's LoRA", Path(lora.path)) for lora in run.spec.loras]
    # Where its files' links lead (a Hub cache snapshot's into ../../blobs): replaced, they break the teacher too.
    linked = sorted({Path(os.path.realpath(f)).parent for f in teacher.rglob("*") if f.is_symlink() and f.is_file()})
    inputs += [("the folder the teacher's files link into", place) for place in linked]
    for what, place in inputs:
        if where := overlap(out, place):
            raise UserError(f"--out {out} {where} {what} {place}, which the export reads; choose a folder outside it")


def checked_teacher_folder(folder: Path) -> Path:
    """`--teacher-path`'s folder, every file of it checked by the guard before anything reads it: no link may lead
    out of it, except, for a Hub cache snapshot (`.../models--org--name/snapshots/<revision>`), into its own repo's
    cache folder (a snapshot's files are links into `../../blobs`). One line naming the link otherwise."""
    folder = folder.expanduser()
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        raise UserError(
            f"--teacher-path {folder} {what}; give the teacher's diffusers-format Wan folder (model_index.json)"
        )
    real = Path(os.path.realpath(folder))
    root = real.parent.parent if real.parent.name == "snapshots" else real
    try:
        check_tree(root, real)
    except OutsideRunFolder as e:
        detail = str(e).split("; ", 1)[0].replace("the run folder", "the teacher folder")
        raise UserError(
            f"--teacher-path {folder}: {detail}; copy the teacher's files into that folder (a Hub cache snapshot "
            "may link only into its own cache)"
        ) from None
    return folder


# The lock a live run holds on its folder (job/rundir.py's LOCK_FILE, which writes `pid N on HOST` into it).
LOCK_FILE = ".lock"


def live_holder(path: Path) -> str | None:
    """Who holds the run folder's lock (`pid N on HOST`): a run still training, or in its end-of-run work, whose
    folder is not finished yet; None for a finished (or killed) run, and for this process's own run or its parent's
    (the run's own end-of-run eval and export). Only read: a shared lock tried and let go at once. On a file system
    without locks, the holder the run wrote there, where it is a live process of this host."""
    try:
        fd = os.open(Path(path) / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # no lock file (a run never started here, a copied folder), or a link in its place
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # no one holds it (the shared lock just taken goes as the file closes)
        except BlockingIOError:
            locked = True
        except OSError as e:
            if e.errno not in NO_LOCKS:
                return None
            locked = False
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
    finally:
        os.close(fd)
    found = re.fullmatch(r"pid (\d+) on (\S+)", holder)
    pid = int(found[1]) if found and found[2] == leftovers.HOST else None  # another host's is not known
    if not locked and (pid is None or not leftovers.alive(leftovers.HOST, pid)):
        return None  # without locks, only a live process of this host is known to hold it
    if pid in _this_process_and_parents():
        return None
    return holder or "another process"


def _this_process_and_parents() -> set[int]:
    pids, pid = {os.getpid()}, os.getpid()
    for _ in range(8):  # a worker of the run's launcher, its launcher, torchrun's agent ...
        try:
            fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
            try:
                stat = os.read(fd, 4096).decode(errors="replace")
            finally:
                os.close(fd)
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 1:
            break
        pids.add(pid)
    return pids


def refuse_live(path: Path, what: str) -> None:
    """A live run's folder is never read as a finished one: its student, metrics and evaluation come last (and a
    card written meanwhile would say "?" or another step count). One line naming who holds it."""
    holder = live_holder(path)
    if holder is not None:
        raise UserError(
            f"{path} is a live run ({holder} holds its .lock): it has not finished writing its student, metrics and "
            f"evaluation; wait for it to end, then {what} again"
        )


# A tool's run folder given empty (an unset variable): Path("") is the current folder, said as '.'.
EMPTY_RUN_FOLDER = "empty (an unset variable?); give an outputs/<date>/<time> folder"


def given_run_folder(path: str | Path) -> Path:
    """A tool's run folder as given; an empty one refused, not read as the current folder."""
    if not str(path).strip():
        raise UserError(f"the run folder given is {EMPTY_RUN_FOLDER}")
    return Path(path).expanduser()


def run_config_file(path: Path) -> Path:
    """A run folder's `.hydra/config.yaml`; a folder without one (a mistyped path) is one line."""
    config = in_run(path, ".hydra/config.yaml")  # a received folder's link to a config elsewhere is refused
    if not config.is_file():
        raise UserError(f"{path} is not a run folder (no .hydra/config.yaml); give an outputs/<date>/<time> folder")
    return config


def run_folder_arg(text: str) -> Path:
    """A tool's run folder argument as a Path (argparse's `type`): `given_run_folder`'s refusal, as argparse's."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"it is {EMPTY_RUN_FOLDER}")
    return Path(text)


def open_run(
    path: str | Path,
    teacher_path: str | None = None,
    allow: tuple[str, ...] = (),
    allow_download: bool = False,
    cache_dir: str | None = None,
    spec: TeacherSpec | None = None,
    teacher_loras: Sequence[str] | None = None,
) -> RunFolder:
    """A run folder (it holds `.hydra/config.yaml`), read as data someone may have sent: its config checked
    before anything in it runs (wandistiller.state.received; `allow`: targets the user trusts), its caches in this
    machine's cache folder, its teacher a local folder (`teacher_path` overrides it, `teacher_loras` its
    teacher.lora files; a Hub id downloads only with `allow_download`; `spec`: that teacher already inspected, by
    the run's own preflight, not read again)."""
    register_resolvers()  # the ones a saved config may use
    path = given_run_folder(path)
    config = run_config_file(path)
    refuse_live(path, "run this")
    cfg = load_received(config, allow, root=path)
    unset = [key for key in ("paths", "teacher", "student") if key not in cfg or OmegaConf.is_missing(cfg, key)]
    if unset:  # an emptied or cut file: every run saves these
        raise UserError(f"{config} is damaged (it has no {unset[0]}: not a run's saved config); restore it")
    cfg.paths.cache_dir, cfg.paths.output_dir = cache_dir or local_cache_dir(), str(path)
    try:  # a `${hydra:…}` (allowed, but only a training job resolves it) or an unset variable: one line
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        first = str(getattr(e, "msg", e)).strip().splitlines()[0]
        raise UserError(
            f"{getattr(e, 'full_key', None) or '?'} in {config}: {first}; fix the interpolation (or set "
            "the variable it reads)"
        ) from None
    latest = latest_places(path, cfg)  # where a resume since found the teacher (a run moved): there, not here
    if latest is not None:
        config = latest[0]
        put_places(cfg, latest[1])
    if teacher_path is not None:
        cfg.teacher.path, cfg.teacher.builtin = str(checked_teacher_folder(Path(teacher_path))), None
    elif not allow_download and looks_like_hub_id(str(cfg.teacher.path)):
        raise UserError(
            f"teacher.path={cfg.teacher.path!r} in {config} is a Hub id, and a received run does not download "
            "what its config names: give a local copy with --teacher-path DIR, or fetch it with --allow-download"
        )
    if spec is None:  # the run's own end-of-run eval: its preflight found them (at the places it was given)
        moved_from(cfg, config, teacher_path is None, teacher_loras)
    if teacher_loras is not None:
        cfg.teacher.lora = relocated(cfg.teacher.get("lora"), teacher_loras, str(config))
    teacher = resolve_teacher_path(cfg.teacher, cfg.paths.cache_dir)
    if spec is None or spec.path != teacher:  # the run's own teacher, with the LoRAs it was distilled from
        spec = with_loras(inspect_teacher(teacher), cfg.teacher.get("lora"))
    return RunFolder(path, cfg, spec)


# Where a run's teacher and its LoRAs lie (a resume may change them: job/resumed.py), and the name its folder gives it.
PLACES = ("teacher.path", "teacher.lora")
NAMED_BY_PATH = ("teacher.name", "teacher.builtin")  # what `name_the_teacher` derives from teacher.path
PLACE_KEYS = PLACES + NAMED_BY_PATH
_RESUME_CONFIG = re.compile(r"config_resume_(\d+)(?:_(\d+))?\.yaml")  # job/rundir.py's save_config names them so


def latest_places(run_dir: Path, cfg: DictConfig) -> tuple[Path, dict] | None:
    """The teacher's places as the run's newest resume config has them (`.hydra/config_resume_<time>.yaml`), where
    they differ from `cfg`'s (the run's first config): (that file, {key: value} of `PLACE_KEYS`), checked to fit
    `cfg` (`put_places`). A resume takes a new `teacher.path` / `teacher.lora` only where its checkpoint's record held
    what it found there (job/resumed.py), so after a move each later resume and tool finds the teacher where it lies
    now, with no flag given again. None where no resume moved them, or its file cannot be read (the places then come
    from `cfg`)."""
    hydra_dir = in_run(run_dir, ".hydra")
    found = sorted(
        ((int(m[1]), int(m[2] or 0)), name)
        for name in (os.listdir(hydra_dir) if hydra_dir.is_dir() else [])
        if (m := _RESUME_CONFIG.fullmatch(name))
    )
    if not found:
        return None
    newest = in_run(run_dir, f".hydra/{found[-1][1]}")
    try:
        places = {key: OmegaConf.select(load_yaml_config(newest, root=run_dir), key) for key in PLACE_KEYS}
        if places == {key: OmegaConf.select(cfg, key) for key in PLACE_KEYS}:
            return None
        if not isinstance(places["teacher.path"], str) or "${" in places["teacher.path"]:
            return None
        put_places(copy.deepcopy(cfg), places)  # all of them fit, or none is taken
    except (UserError, OmegaConfBaseException, yaml.YAMLError, ValueError, OSError):
        return None
    return newest, places


def put_places(cfg: DictConfig, places: dict) -> None:
    for key, value in places.items():
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)


def moved_from(cfg: DictConfig, config: Path, saved_teacher: bool, teacher_loras: Sequence[str] | None) -> None:
    """One line, naming the flag that says where it lies now, for a saved teacher folder or teacher.lora file that
    is no longer there (a run moved to another machine, a teacher moved since)."""
    where = Path(str(cfg.teacher.path)).expanduser()
    if saved_teacher and cfg.teacher.get("builtin") is None and where.is_absolute() and not where.exists():
        raise UserError(
            f"teacher.path={str(where)!r} in {config} is not there (moved, or the run was trained on another "
            "machine); give the teacher's folder with --teacher-path DIR"
        )
    gone = [path for path, _, _ in entries(cfg.teacher.get("lora")) if not Path(path).expanduser().exists()]
    if teacher_loras is None and gone:
        raise UserError(
            f"{LORA_KEY} in {config} names {gone[0]}, which is not there (moved, or the run was trained on another "
            "machine); give its files where they lie now with --teacher-lora FILE [FILE ...], in its order"
        )


def open_relocated(
    path: Path, teacher_path: str | None, teacher_loras: Sequence[str] | None, checkpoint: str | None
) -> RunFolder:
    """The run for an export of its student at `checkpoint`: its teacher, or its LoRAs, where the user says they lie
    now held to what that student recorded (other weights would be shipped under the student's name, so no flag
    bridges them here, and a student that recorded nothing is not exported with a teacher given elsewhere). Where
    its teacher was not moved, the saved teacher.path is held to that record too: a folder since filled with another
    model would otherwise be shipped beside the student without a word."""
    run = open_run(path, teacher_path, teacher_loras=teacher_loras)
    if teacher_path is None and teacher_loras is None:
        # The student the export writes (the final one, or a checkpoint named); none yet is said by the export itself.
        if checkpoint in (None, "ema"):
            source = run.path / "student"
        else:
            try:
                source = student_source(run, checkpoint)
            except UserError:
                return run
        if source.is_dir():
            check_teacher_fits(run, source, allow_other=False, fix="swapped")
        return run
    source = student_source(run, None if checkpoint == "ema" else checkpoint)
    if recorded_teacher(run, source) is None:
        raise UserError(
            f"the student in {source} records no teacher to hold --teacher-path / --teacher-lora to (a run of an "
            "earlier version); export it where its saved teacher.path and teacher.lora still lie"
        )
    check_teacher_fits(run, source, allow_other=False, fix="export")
    return run


def student_source(run: RunFolder, checkpoint: str | None) -> Path:
    """The folder a student comes from: `<run>/student` (the final one), or a checkpoint by name (`ema`: the final
    EMA student, `<run>/student_ema`)."""
    checkpoints = list_checkpoints(run.path)
    if checkpoint is None:
        found = run.path / "student" if (run.path / "student").is_dir() else None
        if found is None and checkpoints:  # said: a run that did not finish is not read as a finished one
            found = checkpoints[-1]
            unfinished = f"{run.path} has no final student (the run did not finish)"
            refuse_linked_in(run.path, unfinished, found, "take it", f"take {found.name}")  # before the line below
            logging.getLogger("wandistiller").warning("%s: its latest checkpoint, %s", unfinished, found.name)
    elif checkpoint == "latest":
        found = checkpoints[-1] if checkpoints else None
    elif checkpoint == "best":
        found = run.path / "checkpoints" / "best"
    elif checkpoint.startswith("step_") and checkpoint[5:].isdigit():
        found = checkpoint_dir(run.path, int(checkpoint[5:]))
    elif checkpoint == "ema":  # the EMA weights trainer.ema_decay kept, saved beside the final student
        found = run.path / "student_ema"
        if not found.is_dir():
            raise UserError(
                f"{run.path} has no student_ema/ (trainer.ema_decay was off, or the run did not finish); drop "
                "--checkpoint ema, or pick best, latest or step_N"
            )
    else:
        raise UserError(f"--checkpoint {checkpoint!r} is not best, latest, step_N or ema")
    final = found is not None and found.name in ("student", "student_ema")
    if found is not None and checkpoint is not None and not final and found.name != "best":  # linked in: said
        key = f"--checkpoint {checkpoint}"
        refuse_linked_in(run.path, key, found, "take it", f"take {found.name}", newer=checkpoint == "latest")
    if found is not None:  # a received folder's `student` or `checkpoints/step_N` linked elsewhere is not loaded
        in_run(run.path, found)
    if found is None or not (final or (found / STATE_FILE).is_file()):
        have = ", ".join(p.name for p in checkpoints) or "none"
        what = "no student yet" if checkpoint is None else f"no checkpoint {checkpoint!r}"
        raise UserError(f"{run.path} has {what} (checkpoints: {have}); train it first or pick another --checkpoint")
    if final:
        check_saved_student(run, found)  # before anything is sampled, as a checkpoint's problem is
    why = None if final else checkpoint_problem(found, resumed=False)
    if why is not None:  # said before anything is sampled, naming the flag that picks another (not trainer.resume)
        others = [p.name for p in checkpoints if p != found]
        pick = f"pick another --checkpoint ({', '.join(others)})" if others else "the run holds no other checkpoint"
        raise UserError(f"--checkpoint {checkpoint or 'latest'}: {found} cannot be read ({clipped(why)}); {pick}")
    return found


def check_saved_student(run: RunFolder, source: Path) -> None:
    """A saved student folder's weights (a transformer's with its config.json, or a LoRA student's adapters): each
    file whole, none through a link out of the run; a damaged one is one line, not diffusers' traceback."""
    if (source / "config.json").is_file():
        check_tree(run.path, source)  # every file from_pretrained opens, at any depth: none through a link out
    for file in sorted(source.glob("*.safetensors")):
        problem = safetensors_problem(file, root=run.path)
        if problem:
            raise UserError(f"the student in {source}: {problem}; use --checkpoint latest (or another)")
    if not (source / "config.json").is_file() and not is_lora_folder(source):
        _checkpoint_folder(source)  # its config.json gone: said now, not once the teacher has sampled


def _shell(run: RunFolder):
    """The run's student, built to receive a checkpoint's weights: random (never read from the teacher), and
    without its "student: random initialisation" line, which would be false of the student then loaded."""

    random = {"init": "random"} if "init" in run.cfg.student else {}
    with quieted("wandistiller.student.model"):
        return instantiate(run.cfg.student, _partial_=True, **random)(spec=run.spec)


def load_student(run: RunFolder, source: Path, device: torch.device, dtype: torch.dtype = torch.float32):
    """The student's WanTransformer3DModel, from a saved folder or a checkpoint's training state."""
    from diffusers import WanTransformer3DModel

    in_run(run.path, source)  # never a received folder's link to a student elsewhere
    if (source / "config.json").is_file():
        check_saved_student(run, source)
        try:
            transformer = _from_opened(WanTransformer3DModel, source, dtype, run.path)
        except (ValueError, RuntimeError, OSError, KeyError, TypeError) as e:  # weights of another shape, a bad config
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise UserError(
                f"the student in {source} cannot be loaded ({first}); use --checkpoint latest (or another)"
            ) from None
    else:
        # The student's shape alone (init=random: nothing is cut or copied, the weights are the checkpoint's), and of
        # its state the transformer: a hidden-state loss's projections are training parts, not the student.
        transformer = _shell(run).transformer
        state = load_checkpoint(_checkpoint_folder(source))  # safetensors + JSON: never unpickles
        state["student"] = {
            k[len("transformer.") :]: v for k, v in state["student"].items() if k.startswith("transformer.")
        }
        # another student's checkpoint: one line, not load_state_dict's traceback
        check_compatible(
            state, transformer, "--checkpoint", "pick one this run trained (--checkpoint latest, best or step_N)"
        )
        transformer.load_state_dict(state["student"])
        transformer = cast_keeping_fp32(transformer, dtype)
    teacher = run.spec.transformer_config
    differ = [
        k
        for k in ("in_channels", "out_channels", "text_dim", "patch_size")
        if transformer.config.get(k)
        != (list(teacher[k]) if isinstance(teacher.get(k), (list, tuple)) else teacher.get(k))
    ]
    if differ:
        raise UserError(
            f"the student in {source} does not fit this run's teacher ({', '.join(differ)} differ); "
            "give the run folder it was trained in"
        )
    return transformer.to(device).eval().requires_grad_(False)


MAX_CONFIG_COUNT = 2**16  # any count or size a received config.json sets: Wan 14B's largest (ffn_dim) is 13824


def _from_opened(model_class, source: Path, dtype: torch.dtype, root: Path):
    """A saved diffusers model folder loaded from what the guard opened, never by path: its config.json read through
    the guard, the model built from it with its weights on the meta device (nothing allocated), every weights file
    read from its opened descriptor (a file swapped for a link meanwhile is not what is read), each tensor's shape
    held to the model's before any is placed. A count the config sets (`num_layers` of 10**9) is held to the weights
    first: no memory is taken for blocks the files do not hold. Closes from_pretrained's check-then-read gap."""
    from accelerate import init_empty_weights

    config = read_json_in(root, source / "config.json", what="the student's config.json")  # inside the run (`root`)
    if not isinstance(config, dict):
        raise ValueError("config.json is not a JSON object")
    for key, value in config.items():  # every size it sets (rope's buffers are built for real): Wan's are < 2**14
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= MAX_CONFIG_COUNT:
            raise ValueError(f"config.json {key}={value} is out of bounds (0 to {MAX_CONFIG_COUNT})")
    state: dict[str, torch.Tensor] = {}
    for file in sorted(source.glob("*.safetensors")):
        with opened(root, file) as path:
            state.update(load_file(path))
    blocks = {int(k.split(".")[1]) for k in state if k.startswith("blocks.") and k.split(".")[1].isdigit()}
    layers = config.get("num_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers != len(blocks):
        raise ValueError(f"config.json num_layers={layers!r} does not match its weights ({len(blocks)} blocks)")
    with init_empty_weights(include_buffers=False):  # the parameters on meta; buffers (rope) real and small
        model = model_class.from_config(config)
    expected = dict(model.state_dict())
    wrong = [k for k in expected if k in state and tuple(state[k].shape) != tuple(expected[k].shape)]
    missing, extra = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if wrong or missing or extra:
        raise ValueError(
            f"its weights do not fit its config.json (shape differs: {wrong[:3]}, missing: {missing[:3]}, "
            f"unexpected: {extra[:3]})"
        )
    model.load_state_dict(state, strict=True, assign=True)
    return cast_keeping_fp32(model, dtype)


def _checkpoint_folder(source: Path) -> Path:
    """`source`, a checkpoint (its state.json), or refused in one line: a saved student folder whose config.json is
    gone was read as a checkpoint, and its line named trainer.resume and a tensors.safetensors it never held."""
    if not (source / STATE_FILE).is_file() and not (source / LEGACY_FILE).is_file():
        raise UserError(
            f"the student in {source} has no config.json (its weights without their shape) and is not a checkpoint; "
            "restore its config.json, or use --checkpoint latest (or another)"
        )
    return source


def student_sampler(run: RunFolder, source: Path, device: torch.device, dtype: torch.dtype = torch.float32) -> Teacher:
    """The run's student at `source` as a sampler without CFG: its transformer in the teacher's place, or a LoRA
    student's (student=lora) teacher experts, loaded afresh, with its adapters merged in (both of a two-expert
    teacher, switched at its boundary as WanPipeline does)."""

    if not is_lora(run.cfg.student):
        return as_sampler(run.spec, load_student(run, source, device, dtype), device)
    in_run(run.path, source)  # never a received folder's link to a student elsewhere
    checkpoint = None if is_lora_folder(source) else load_checkpoint(_checkpoint_folder(source))["student"]
    experts = merged_experts(run.spec, source, run.cfg.student, dtype, device, checkpoint, root=run.path)
    return Teacher(run.spec, experts, [1.0] * len(experts), device)


def recorded_teacher(run: RunFolder, source: Path) -> dict | None:
    """The teacher the student at `source` was trained against, as recorded: a checkpoint's own record, else
    (the final student) metrics.json's `teacher_*` fields; None where nothing was recorded (older runs)."""

    try:
        if (source / STATE_FILE).is_file():
            state = load_json(in_run(run.path, source / STATE_FILE), what="checkpoint state", root=run.path)
            return state.get("teacher")
        m = load_json(in_run(run.path, "metrics.json"), what="metrics.json", root=run.path)
        return {
            "name": m.get("teacher"),
            "shape": m.get("teacher_shape"),
            "digest": m.get("teacher_digest"),
            "tensors_digest": m.get("teacher_tensors_digest"),
            "experts": m.get("teacher_experts"),
            "loras": m.get("teacher_loras") or [],  # a fine-tuned teacher's (teacher.lora); none recorded: none
        }
    except (OSError, ValueError, AttributeError, UserError):
        return None


def run_layout_problem(run: RunFolder, source: Path) -> str | None:
    """Why eval and generate cannot draw this student, in words: a student runs only on the layout it was trained on
    (`checkpoint.layout_problem`), which no --allow-other-teacher bridges. None where it fits."""
    why = layout_problem(recorded_teacher(run, source), run.spec)
    return f"{why}; give it the teacher it was trained with (--teacher-path that teacher's folder)" if why else None


def lora_teacher_problem(run: RunFolder, source: Path) -> str | None:
    """Why a LoRA student cannot be drawn on this teacher, in words: it holds one adapter set per expert of the
    teacher it was trained on (a saved folder's files, a checkpoint's record), each shaped by that teacher's layers,
    and a teacher with another count of experts or another shape (`adapters_problem`) cannot take them, whatever
    --allow-other-teacher says. None where they fit, for a student that is not LoRA, or where nothing says."""
    if not is_lora(run.cfg.student):
        return None
    recorded = recorded_teacher(run, source) or {}
    held = recorded.get("experts") if isinstance(recorded.get("experts"), int) else None
    if is_lora_folder(source):
        held = sum(1 for name in LORA_WEIGHTS if (source / name).is_file())
    why = adapters_problem(held, recorded.get("shape"), run.spec)
    if why is None:
        return None
    return f"{why}; give it the teacher it was trained with (--teacher-path that teacher's folder)"


def check_teacher_fits(run: RunFolder, source: Path, allow_other: bool, fix: str = "cli") -> None:
    """eval and generate (and an export given its teacher's place) refuse, in one line ending with
    `OTHER_TEACHER_FIX[fix]`, a teacher other than the one the student was trained against (a `--teacher-path` of
    another shape, a saved teacher.path edited): its figures would be silently wrong. A student of another layout
    (`run_layout_problem`), or a LoRA student's adapters on a teacher of another count of experts or another shape
    (`lora_teacher_problem`), is refused whatever `allow_other` says: it cannot run at all."""
    layout = run_layout_problem(run, source) or lora_teacher_problem(run, source)
    if layout:
        done = "drawn here" if fix == "cli" else "exported with this teacher"
        raise UserError(f"the student in {source} cannot be {done}: {layout}")
    why = None if allow_other else teacher_problem(recorded_teacher(run, source), run.spec)
    if why:
        raise UserError(f"the student in {source} does not fit this teacher: {why}; {OTHER_TEACHER_FIX[fix]}")


def check_frames(run: RunFolder) -> None:
    """A clip run against an image teacher, or a one-frame run against a video teacher, is one line before any work:
    its figures would judge what the teacher never made."""
    why = pocket_frames_problem(run.spec.path, int(run.latent_shape[1]))
    if why:
        raise UserError(
            f"{why}; use it with the teacher it was trained with (--teacher-path that teacher's folder: a run's "
            "frames are fixed when it trains)"
        )


def teacher_identity(spec: TeacherSpec) -> dict:
    """The teacher a result was judged against, as checkpoints record it: its folder and its weights' digests (the
    coarse one, and every tensor's, which tells apart fine-tunes the coarse one can miss)."""

    return {"path": str(spec.path), "digest": teacher_digest(spec), "tensors_digest": tensors_digest(spec)}


def other_teacher_tag(run: RunFolder, source: Path, allow_other: bool) -> str | None:
    """`teacher-<digest>`, the name a result carries where it was judged, with --allow-other-teacher, against a
    teacher that is not the one the student recorded (or one nothing was recorded of): its own file, so nothing a
    run wrote against its own teacher is replaced by it. None for the recorded teacher, or without the flag."""
    if not allow_other:
        return None
    recorded = recorded_teacher(run, source)
    if isinstance(recorded, dict) and isinstance(recorded.get("digest"), str):
        if teacher_problem(recorded, run.spec) is None:
            return None
    # Every tensor's digest: two fine-tunes of a few layers can share the coarse one, and would share one file.
    return f"teacher-{tensors_digest(run.spec)[:12]}"


def as_sampler(spec: TeacherSpec, transformer, device: torch.device) -> Teacher:
    """The student in the teacher's place: one expert, no CFG."""
    return Teacher(spec, [transformer], [1.0], device)
