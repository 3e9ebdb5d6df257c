"""The run folder: claimed by one live run at a time, never written over another run's outputs.

A live run holds an exclusive `flock` on `<run_dir>/.lock` through a descriptor kept open for the
life of the process. The OS releases it when the process ends, however it ends (exit, crash, kill -9),
so a lock is never stale and needs no cleanup; a second run started into the folder meanwhile is
refused with one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf, read_write

from wandistiller.core import leftovers
from wandistiller.core.atomic import flocked
from wandistiller.core.errors import RunDirTaken, UserError, exit_on_user_error
from wandistiller.core.files import (
    appendable,
    check_appended,
    clean_run_leftovers,
    enclosing_run,
    folder_problem,
    held_run,
    in_run,
    run_folder,
    run_holding,
)
from wandistiller.state.checkpoint import clean_leftovers, list_checkpoints, resolve_resume

LOCK_FILE = ".lock"
MISSING_BEFORE: set[Path] = set()  # run folders named on the command line that did not exist before Hydra made them
log = logging.getLogger(__name__)
_held: dict[Path, int] = {}  # run folder -> the open descriptor holding its lock (never closed on purpose)


def claim_run_dir(run_dir: Path, resume: str | None) -> Path | None:
    """Refuse to write over another run's outputs or beside a live run; return the checkpoint to resume from.

    Outputs are checked before anything is created, so a refused run leaves no folder behind. Once the
    lock is held, what killed processes left in the folder is cleaned up.
    """
    outer = enclosing_run(run_dir)
    if outer is not None:  # its student/, checkpoints/ or pipeline/ would take a run's files
        raise RunDirTaken(
            f"the run folder {run_dir} lies inside the run folder {outer}, whose outputs it would mix with its own; "
            "choose a folder outside it with hydra.run.dir=…"
        )
    below = held_run(run_dir)  # itself where it is a run (a resume)
    if below is not None and below != run_dir:  # outputs/, say: the run's student/ and checkpoints/ among others
        raise RunDirTaken(
            f"the folder {run_dir} holds the run folder {below}, and a run's folder holds that run alone; choose a "
            "new folder with hydra.run.dir=…"
        )
    exported = _exported(run_dir)
    if exported:  # a run never writes these at its top: resumed or fresh, it would mix its files into a model's
        raise RunDirTaken(
            f"the folder {run_dir} holds an exported model ({exported[0]}), not a run; "
            "choose a new folder with hydra.run.dir=…"
        )
    finished = [p.name for p in (run_dir / "metrics.json", run_dir / "student") if p.exists()]
    earlier = list_checkpoints(run_dir)
    if finished and not earlier:  # nothing to continue from: resumed, it would train from step 0 over its student
        raise RunDirTaken(
            f"the run folder {run_dir} holds a finished run's outputs ({' and '.join(finished)}) and no checkpoint "
            f"to continue it from; to train on from its student, start a new run with student.init={run_dir}/student "
            "hydra.run.dir=<a new folder>, or choose a new folder with hydra.run.dir=…"
        )
    if earlier and resume != "auto":
        raise RunDirTaken(
            f"the run folder {run_dir} already holds another run's outputs (checkpoints up to {earlier[-1].name}); "
            "add trainer.resume=auto to continue it, or choose a new folder with hydra.run.dir=…"
        )
    if resume == "auto" and (not run_dir.exists() or run_dir.resolve() in MISSING_BEFORE):
        log.warning(
            "trainer.resume=auto: no run in %s yet, so a new one starts there (normal for a first launch; if you "
            "meant to continue a run, check its folder's name: hydra.run.dir=…)",
            run_dir,
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    lock_run_dir(run_dir)
    clean_leftovers(run_dir)
    clean_run_leftovers(run_dir)
    check_appended(run_dir)  # a received folder's links out of it: refused before anything is read or written
    return resolve_resume(resume, run_dir)


def note_missing_run_dir(argv: list[str]) -> None:
    """Before Hydra makes the run folder: remember a `hydra.run.dir=` that does not exist yet, so that
    `trainer.resume=auto` into a mistyped folder is told apart from a preempted job's empty one."""
    for arg in argv:
        if arg.startswith("hydra.run.dir=") and "${" not in arg:
            folder = Path(arg.split("=", 1)[1]).expanduser()
            if not folder.exists():
                MISSING_BEFORE.add(folder.resolve())


def lock_run_dir(run_dir: Path) -> None:
    """Hold `run_dir`'s lock until this process ends; refuse (RunDirTaken) if a live run holds it."""
    key = run_dir.resolve()
    if key in _held:  # this process's own earlier job in the same folder (tests, in-process sweeps)
        return
    appendable(key, LOCK_FILE)  # a link in its place (to a file of yours) would be truncated below
    try:
        fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise UserError(
            f"the run folder {run_dir} cannot be written ({e.strerror}); choose another with hydra.run.dir=…"
        ) from None
    try:
        free = flocked(fd, f"the run folder {run_dir}")
    except UserError as e:  # its owner cannot be checked: not ours to write into (a sweep records nothing there)
        os.close(fd)
        raise RunDirTaken(f"{e}; choose another folder with hydra.run.dir=…") from None
    if not free:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunDirTaken(
            f"the run folder {run_dir} is in use by a live run ({holder}); wait for it to end, "
            "or choose a new folder with hydra.run.dir=…"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {leftovers.HOST}\n".encode(), 0)
    _held[key] = fd


def release_run_dir(run_dir: Path) -> None:
    """Give the lock back before the process ends (a long-lived process that runs several jobs)."""
    fd = _held.pop(run_dir.resolve(), None)
    if fd is not None:
        os.close(fd)


def save_config(run_dir: Path, cfg, resume_from: Path | None) -> Path:
    """The composed config, as Hydra would write it; a resumed run keeps the first run's and adds its own. Returns
    the file written."""

    hydra_dir = run_folder(run_dir, ".hydra")
    mine = in_run(run_dir, ".hydra/config.yaml")
    path = _new_file(hydra_dir, "config") if mine.exists() or mine.is_symlink() else mine
    OmegaConf.save(cfg, path)
    if HydraConfig.initialized() and path.name == "config.yaml":
        OmegaConf.save(HydraConfig.get().overrides.task, hydra_dir / "overrides.yaml")
    return path


def _new_file(folder: Path, stem: str) -> Path:
    """`<stem>_resume_<time>[_N].yaml`, created here (O_EXCL): two resumes in the same second keep both."""
    base = f"{stem}_resume_{int(time.time())}"
    for n in range(1000):
        path = folder / (f"{base}.yaml" if n == 0 else f"{base}_{n}.yaml")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            return path
        except FileExistsError:
            continue
    raise UserError(f"{folder} holds 1000 resumes' configs from this second; wait a second and resume again")


# What a refused run may have put in a folder it created: Hydra's logs (train.log, train_rank<N>.log under
# torchrun), the lock, the config saved once the folder was claimed, and the student's pruning.json, written as
# setup builds it (before a refusal there: a resumed checkpoint's networks that do not fit the method's).
# What a run writes before its first step (a refusal at setup: a hook's setting checked against the teacher), the
# loggers' folders included; removed only from a folder that held nothing but logs when the job began.
_OURS_IF_REFUSED = {LOCK_FILE, ".hydra", "pruning.json", "wandb", "tensorboard", "metrics.csv"}


@contextlib.contextmanager
def removed_if_refused(run_dir: Path) -> Iterator[None]:
    """A run refused before it trained leaves no folder behind. Hydra creates the folder (and its log)
    before the job starts, so the folder is removed on a refusal if it held nothing but logs when the job
    began and holds nothing but logs, the lock and the saved config now. A folder another run left
    outputs in is never touched (its contents were there before), nor one another live run holds."""
    before = _contents(run_dir)
    try:
        yield
    except UserError as e:
        if before <= _logs(before) and _contents(run_dir) <= _logs(_contents(run_dir)) | _OURS_IF_REFUSED:
            # A folder taken by another run is left, unless Hydra made it for this command and it holds only its
            # empty log (a run folder named inside another run's: the empty log was left in that run).
            if not isinstance(e, RunDirTaken) or _only_this_commands_empty_log(run_dir):
                shutil.rmtree(run_dir, ignore_errors=True)
                _remove_if_an_empty_date_folder(run_dir.parent)
        elif not (run_dir / LOCK_FILE).exists():  # never a run's folder (an export's): Hydra's empty log goes
            for name in _logs(_contents(run_dir)):
                with contextlib.suppress(OSError):
                    if (run_dir / name).stat().st_size == 0:
                        (run_dir / name).unlink()
        raise


def _remove_if_an_empty_date_folder(folder: Path) -> None:
    """The default run folder is outputs/<date>/<time>: Hydra made the date folder (and on a first run
    outputs/) for this run too, so a refusal that leaves them empty removes them (rmdir: never one another run
    has put a folder in). A folder of another name is the user's own and stays."""
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", folder.name):
        with contextlib.suppress(OSError):
            folder.rmdir()
            if folder.parent.name in ("outputs", "multirun"):
                folder.parent.rmdir()


def _exported(folder: Path) -> list[str]:
    """What marks `folder` as an `export` or `pipeline` output: a pipeline's model_index.json, a single file's
    config.json, a ComfyUI workflow (sorted names; none for a run folder, whose models lie in its subfolders)."""
    if not folder.is_dir():
        return []
    names = (p.name for p in folder.iterdir())
    return sorted(n for n in names if n in ("model_index.json", "config.json") or n.endswith(".workflow.json"))


def _only_this_commands_empty_log(run_dir: Path) -> bool:
    """Whether `run_dir` did not exist before this command (MISSING_BEFORE) and holds nothing but empty logs."""
    if run_dir.resolve() not in MISSING_BEFORE:
        return False
    contents = _contents(run_dir)
    return contents <= _logs(contents) and all((run_dir / n).stat().st_size == 0 for n in contents)


def _contents(run_dir: Path) -> set[str]:
    return {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()


def _logs(names: set[str]) -> set[str]:
    return {n for n in names if n.startswith("train") and n.endswith(".log")}


def unique_folder(folder: Path) -> Path:
    """`folder`, or `folder_1`, `folder_2`, ... : the first one this process creates itself. The default run
    folder is named by the second, so two runs started in the same second would otherwise share one;
    mkdir is atomic, so two processes never both get the same name."""
    for n in range(1000):
        candidate = folder if n == 0 else folder.with_name(f"{folder.name}_{n}")
        try:
            candidate.parent.mkdir(parents=True, exist_ok=True)
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
        except OSError:
            return folder  # cannot be created: the check that follows says why, in one line
    return folder


def check_sweep_folder(folder: Path, overrides: list[str]) -> None:
    """A sweep's folder holds no run's outputs, and no earlier sweep unless this one continues it (an audit's: a sweep
    into a finished run wrote its report and points into it, and one into an earlier sweep reported the old sweep's
    numbers as its own, exit 0)."""
    run = run_holding(folder)
    if run is not None:
        raise UserError(
            f"hydra.sweep.dir={folder} is or lies in the run folder {run}; choose a new folder with hydra.sweep.dir=…"
        )
    continues = "trainer.resume=auto" in overrides
    earlier = folder.is_dir() and ((folder / "multirun.yaml").is_file() or held_run(folder, depth=2) is not None)
    if earlier and not continues:
        raise UserError(
            f"hydra.sweep.dir={folder} holds an earlier sweep; add trainer.resume=auto to continue its points, or "
            "choose a new folder with hydra.sweep.dir=…"
        )


class RunDirCheck(Callback):
    """A Hydra callback: the run (or sweep) folder can be created and written, checked before Hydra
    creates it for its log -- otherwise Hydra's own mkdir fails with a traceback before any of our code."""

    def on_run_start(self, config, **kwargs) -> None:

        given = any(o.split("=", 1)[0].lstrip("+~") == "hydra.run.dir" for o in config.hydra.overrides.hydra)
        if not given and "TORCHELASTIC_RUN_ID" not in os.environ:  # torchrun ranks agree on the time-named one
            with read_write(config.hydra.run):
                config.hydra.run.dir = str(unique_folder(Path(str(config.hydra.run.dir))))
        self._check(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config, **kwargs) -> None:
        self._check(config.hydra.sweep.dir, "hydra.sweep.dir")
        with exit_on_user_error():
            check_sweep_folder(Path(str(config.hydra.sweep.dir)), list(config.hydra.overrides.task))

    @staticmethod
    def _check(folder: str, key: str) -> None:

        problem = folder_problem(Path(str(folder)))
        with exit_on_user_error():
            if problem:
                raise UserError(f"{key}: {problem}; choose another folder with {key}=…")
            if Path(str(folder)).is_dir():  # Hydra appends to train.log next: never through a link out of the folder
                for log_file in Path(str(folder)).glob("train*.log"):
                    appendable(Path(str(folder)), log_file.name)
