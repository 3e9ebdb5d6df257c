"""Checkpoints that never run code, written atomically, and resumes that never strand a run.

A checkpoint is a folder `checkpoints/step_NNNNNNNN` holding `tensors.safetensors` (student, optimizer
and EMA tensors, torch RNG) and `state.json` (everything else); see `safestate`. It is written to a
temporary folder named for its writer (`.tmp-step_…-<host>-<pid>`) and renamed, so a crash never
leaves a torn one, and the next start can remove what a dead writer left (`clean_leftovers`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import torch

from wandistiller.core import leftovers
from wandistiller.core.arch import Layout
from wandistiller.core.errors import UserError, clipped, quieted
from wandistiller.core.files import in_run, run_folder, write_in_run
from wandistiller.state import safestate
from wandistiller.state.received import load_json
from wandistiller.student.model import current_state
from wandistiller.teacher.finetune import records as lora_records
from wandistiller.teacher.finetune import stamp

log = logging.getLogger(__name__)
CHECKPOINTS = "checkpoints"
STATE_FILE = "state.json"
TENSORS = "tensors.safetensors"
LEGACY_FILE = "state.pt"  # a pickle, written before checkpoints were data: listed, never loaded
REQUIRED = {"student", "optimizer", "lr_scheduler", "scaler", "ema", "tracker_run_id", "rng"}
TMP, PRUNE = r"\.tmp-(?:step_\d+|best)", r"\.prune-(?:step_\d+|best)"  # temporary names, before `-<host>-<pid>`


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step_{step:08d}"


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint was taken at: the one its state records (a folder renamed or copied keeps
    it), else the one its name says; -1 when neither can be read."""
    try:
        step = _read_state(path).get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            return step
    except (OSError, ValueError, AttributeError, UserError):
        pass
    return _step_of_name(path)


def _step_of_name(path: Path) -> int:
    return int(path.name[len("step_") :]) if re.fullmatch(r"step_\d+", path.name) else -1


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Finished checkpoints, oldest step first (temporary folders start with '.' and are skipped).

    A finished one that was later damaged is listed too; `problem` says whether it can be loaded.
    """
    root = in_run(run_dir, CHECKPOINTS)  # `checkpoints -> ../other_run/checkpoints` is refused: never read or pruned
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file() or (p / LEGACY_FILE).is_file()]
    found = [p for p in found if _inside(run_dir, p)]  # one linked in from outside: refused by `refuse_linked_in`
    return sorted(found, key=lambda p: (checkpoint_step(p), p.name))  # by the step inside, not name or mtime


def _leading_out(run_dir: Path) -> list[tuple[Path, Path]]:
    """(checkpoint, link) for each `step_*` in the run's checkpoints/ that is, or holds, a link leading out of the run
    folder (`ln -s`, or a copy made with `cp -rs`), oldest first: never read, and never passed over by a resume."""
    root = in_run(run_dir, CHECKPOINTS)
    found = []
    for entry in root.glob("step_*") if root.is_dir() else []:
        if entry.is_symlink():
            links = [entry]
        else:
            links = sorted(f for f in entry.iterdir() if f.is_symlink()) if entry.is_dir() else []
        out = next((link for link in links if not _inside(run_dir, link)), None)
        if out is not None:
            found.append((entry, out))
    return sorted(found, key=lambda pair: _step_of_name(pair[0]))


def _inside(run_dir: Path, path: Path) -> bool:
    try:
        in_run(run_dir, path)
        return True
    except UserError:
        return False


def _read_state(path: Path):
    """A checkpoint's state.json, its size bounded before parsing (see received.load_json), opened through the guard
    inside the checkpoint's folder: a link out of it is refused, never followed."""

    return load_json(path / STATE_FILE, what="checkpoint state", root=path)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, state: dict, keep: int) -> Path:
    """Write the checkpoint for `step` whole or not at all, then prune to the newest `keep`.

    A failed write (a full disk, no permission) removes its temporary folder and is one UserError naming
    the folder and the space it needs; the checkpoints written before stay as they were.
    """
    run_folder(run_dir, CHECKPOINTS)  # inside the run folder, never through a link out of it
    final = write_checkpoint(checkpoint_dir(run_dir, step), step, state)
    _prune(run_dir, step, keep)
    return final


def write_checkpoint(final: Path, step: int, state: dict) -> Path:
    """The checkpoint folder `final`, written whole (to a temporary sibling, then renamed) or not at all."""
    run_folder(final.parent.parent, final.parent.name)  # checkpoints/ lies inside the run folder
    tmp = final.with_name(leftovers.owned_name(f".tmp-{final.name}"))
    tensors: dict[str, torch.Tensor] = {}
    data = safestate.encode(state | {"step": step, "rng": rng_state()}, tensors)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        safestate.write_tensors(tmp / TENSORS, tensors)
        write_in_run(tmp, STATE_FILE, json.dumps(data))  # fsynced, as the tensors are
        if final.exists() or final.is_symlink():  # the same step saved again after a resume: move the old one aside
            _discard(final)
        os.rename(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(_save_failed(final.parent, e, safestate.tensor_bytes(tensors))) from None
    return final


def _save_failed(folder: Path, error: OSError, nbytes: int) -> str:
    try:
        free = f"{_size(shutil.disk_usage(folder).free)} is free"
    except OSError:
        free = "its free space cannot be read"
    return (
        f"could not write a checkpoint into {folder} ({error.strerror or error}): it needs about "
        f"{_size(nbytes)} free there and {free}; free some space (or fix the folder's permissions) "
        "and resume with trainer.resume=auto -- the earlier checkpoints are intact"
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _discard(folder: Path) -> None:
    """Delete a checkpoint folder so that a kill midway leaves no half-deleted `step_*`: it is first
    renamed to a temporary name that the next start's cleanup recognises."""
    if folder.is_symlink():  # a link (a received folder's) goes itself: what it points to is never touched
        folder.unlink()
        return
    doomed = folder.with_name(leftovers.owned_name(f".prune-{folder.name}"))
    os.rename(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _prune(run_dir: Path, step: int, keep: int) -> None:
    """Keep the newest `keep` checkpoints up to `step`. Later ones (skipped as unreadable by a resume)
    are left alone: this run replaces each of them when it gets there."""
    if keep <= 0:
        return
    # Unusable ones are neither counted nor removed: they are left for the user to look at.
    earlier = [p for p in list_checkpoints(run_dir) if checkpoint_step(p) <= step and problem(p) is None]
    for old in earlier[:-keep]:
        try:
            _discard(old)
        except OSError as e:
            log.warning("could not remove the old checkpoint %s: %s", old, e.strerror or e)


def clean_leftovers(run_dir: Path) -> None:
    """Remove what killed processes left in `run_dir/checkpoints`: temporary folders of saves and
    prunes whose writer is gone, and `step_*` folders a pre-release prune emptied in place."""
    root = run_dir / CHECKPOINTS
    leftovers.remove_dead(root, TMP)
    leftovers.remove_dead(root, PRUNE)
    for folder in root.glob("step_*") if root.is_dir() and not root.is_symlink() else []:
        if folder.is_symlink():  # never followed into, never removed: a user's (or a sender's) link
            continue
        names = {p.name for p in folder.iterdir()} if folder.is_dir() else {LEGACY_FILE}
        if names < {STATE_FILE, TENSORS}:  # only our files, and not all of them: a torn delete
            shutil.rmtree(folder, ignore_errors=True)
            log.info("removed %s, a checkpoint folder an interrupted cleanup left incomplete", folder)


def problem(path: Path, resumed: bool = True) -> str | None:
    """Why the checkpoint at `path` cannot be resumed from (or, not `resumed`, its student read), or None. Cheap:
    JSON and a header only."""
    if not (path / STATE_FILE).is_file() and (path / LEGACY_FILE).is_file():
        return (
            f"it holds only {LEGACY_FILE}, a pickle from an older WanDistiller, which training never loads because "
            f"unpickling can run code (python -m wandistiller.legacy {path} converts it safely)"
        )
    try:
        state = _read_state(path)
        whole = isinstance(state, dict) and isinstance(state.get("step"), int) and not REQUIRED - state.keys()
        if not isinstance(state, dict) or (resumed and not whole):
            return f"{STATE_FILE} is not a checkpoint's state"
        names = safestate.check_tensors(path / TENSORS, path)
        safestate.decode(state, dict.fromkeys(names))  # every reference resolves, every value is ours
    except FileNotFoundError as e:
        return f"{Path(e.filename).name} is missing"
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError, UserError) as e:
        what = f"lacks {e}" if isinstance(e, KeyError) else clipped(str(e)) or type(e).__name__
        return f"{STATE_FILE} or {TENSORS} is damaged ({what})"
    return None


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    """trainer.resume: None (new run), 'auto' (latest checkpoint in this run folder, if any), or a folder.

    'auto' (and a run folder) skips checkpoints that cannot be loaded, newest first, one line each;
    an explicit checkpoint folder that cannot be loaded is one UserError.
    """
    if resume is None:
        return None
    if resume == "auto":
        found, newest_why = _newest_usable(run_dir, "trainer.resume=auto", own=True)
        if found is None and list_checkpoints(run_dir):  # starting over would replace the run's outputs
            raise UserError(
                f"trainer.resume=auto: none of the checkpoints in {run_dir / CHECKPOINTS} can be resumed from (the "
                f"newest: {newest_why}); move them away to start this run over, or choose a new folder with "
                "hydra.run.dir=…"
            )
        if found is None:  # right for a preempted job's first launch; said, so a mistyped folder is noticed
            log.info("trainer.resume=auto: no checkpoint in %s; starting from step 0", run_dir / CHECKPOINTS)
        return found
    path = Path(resume).expanduser()
    if (path / STATE_FILE).is_file() or (path / LEGACY_FILE).is_file():
        why = problem(path)
        if why is not None:
            raise UserError(f"trainer.resume={resume!r} cannot be resumed from: {why}; point it at another checkpoint")
        return path
    if list_checkpoints(path):  # a run folder: take its latest usable one
        own = os.path.realpath(path) == os.path.realpath(run_dir)  # this run's folder named: as auto
        found, newest_why = _newest_usable(path, f"trainer.resume={resume!r}", own)
        if found is not None:
            return found
        raise UserError(
            f"trainer.resume={resume!r}: none of its checkpoints can be resumed from (the newest: {newest_why}); "
            "point it at another checkpoint"
        )
    raise UserError(
        f"trainer.resume={resume!r} is neither a checkpoint folder (holding {STATE_FILE}) nor a run folder with "
        "checkpoints; use trainer.resume=auto or a path under <run>/checkpoints/"
    )


def resume_candidate(resume: str | None, run_dir: Path, refuse: bool = False) -> Path | None:
    """The checkpoint `resolve_resume` would pick, found without a word (None where there is none): what a resume's
    checks read before the run folder is claimed. Where it would refuse: None, or with `refuse` its one line (a
    refused resume then writes nothing into the run, not even its lock). The resolution after the claim says what
    it skipped."""
    with quieted(__name__, logging.CRITICAL):
        try:
            return resolve_resume(resume, run_dir)
        except UserError:
            if refuse:
                raise
            return None


def _newest_usable(run_dir: Path, key: str, own: bool) -> tuple[Path | None, str]:
    """(the newest checkpoint that can be loaded, or None; why the newest of all cannot, where it cannot). Those
    skipped on the way are said (a line each) only where one is found: a refusal names the newest's problem. `own`:
    `run_dir` is the run this resume trains on, whose newer checkpoints linked in from outside are refused."""
    skipped: list[tuple[Path, str]] = []
    for path in reversed(list_checkpoints(run_dir)):
        why = problem(path)
        if why is None:
            if own:
                _refuse_newer_links(run_dir, key, path)
            for old, old_why in skipped:
                log.warning("%s: skipping %s: %s", key, old, old_why)
            return path, ""
        skipped.append((path, why))
    if own:
        _refuse_newer_links(run_dir, key, None)
    return None, f"{skipped[0][0].name}: {skipped[0][1]}" if skipped else ""


def _refuse_newer_links(run_dir: Path, key: str, found: Path | None) -> None:
    """A checkpoint linked in from outside the run is never resumed from; one newer than the one a resume would
    take is refused rather than passed over: training from the older step would replace it when it got there, and
    the steps the user linked in for would be trained again unasked."""
    then = f"resume from {found.name}" if found is not None else "start from step 0"
    refuse_linked_in(run_dir, key, found, "resume from it", then)


def refuse_linked_in(run_dir: Path, key: str, found: Path | None, use: str, then: str, newer: bool = True) -> None:
    """One line where `found` itself, or (with `newer`) a checkpoint of the run past its step (None: any), is or
    holds a link out of the run folder: never read, and never passed over for an older one unsaid. `use`: what
    copying it in does; `then`: what removing it does (`found` itself refused: pick another)."""
    after = checkpoint_step(found) if found is not None else -1
    out = [(e, link) for e, link in _leading_out(run_dir) if e == found or (newer and _step_of_name(e) > after)]
    if not out:
        return
    entry, link = out[-1]
    real, named, here = os.path.realpath(link), shlex.quote(str(entry)), shlex.quote(str(entry) + ".copy")
    otherwise = "pick another --checkpoint" if entry == found else f"remove {named} to {then}"
    if not os.path.exists(real):
        raise UserError(f"{key}: {link} is a link to {real}, which is not there: {otherwise}")
    if link == entry:  # the checkpoint itself is the link
        copy = f"rm {named} && cp -r {shlex.quote(real)} {named}"
    else:  # a folder of links (cp -rs): each file copied in
        copy = f"cp -rL {named} {here} && rm -r {named} && mv {here} {named}"
    raise UserError(
        f"{key}: {link} leads out of the run folder (to {real}), and a run reads its checkpoints only inside it: "
        f"copy it in ({copy}) to {use}, or {otherwise}"
    )


def load_checkpoint(path: Path) -> dict:
    """The saved state (keys as `training_state` wrote them, plus "step" and "path"); sets the RNGs."""
    try:
        safestate.check_tensors(path / TENSORS, path)  # every header check first: safetensors' errors are terse
        tensors = safestate.read_tensors(path / TENSORS, path)  # what the guard opened, never a link out
        state = safestate.decode(_read_state(path), tensors)
        set_rng_state(state["rng"])
    except Exception as e:  # safetensors raises its own error types; any of them means a damaged file
        raise UserError(f"trainer.resume: the checkpoint {path} cannot be read ({str(e)[:200]})") from None
    return state | {"path": str(path)}


RESUME_FIX = "resume with the student config it was trained with, or start a new run folder"


def check_compatible(state: dict, student: torch.nn.Module, key: str = "trainer.resume", fix: str = RESUME_FIX) -> None:
    """Refuse a checkpoint of another student shape with one line, before load_state_dict's traceback."""
    student = getattr(student, "module", student)  # DDP
    expected = {k: tuple(v.shape) for k, v in student.state_dict().items()}
    saved = {k: tuple(v.shape) for k, v in state["student"].items()}
    if saved == expected:
        return
    missing, extra = sorted(expected.keys() - saved.keys()), sorted(saved.keys() - expected.keys())
    changed = [k for k in expected.keys() & saved.keys() if expected[k] != saved[k]]
    if changed:
        k = sorted(changed)[0]
        detail = f"{k} is {list(saved[k])} there and {list(expected[k])} here"
    else:
        detail = f"it has {len(extra)} tensors this student lacks and lacks {len(missing)} of its own"
        detail += f" (e.g. {(missing or extra)[0]})"
    raise UserError(
        f"{key}: the checkpoint{' ' + state['path'] if 'path' in state else ''} is of another student "
        f"shape ({detail}); {fix}"
    )


def restore(state: dict, student, optimizer, lr_scheduler, scaler, ema) -> None:
    """Load a checkpoint's state into the run's objects; a mismatch is one UserError, not a traceback."""

    state["student"] = current_state(state["student"])  # an older checkpoint's names, as the student has them now
    check_compatible(state, student)
    try:
        student.load_state_dict(state["student"])
        optimizer.load_state_dict(state["optimizer"])
        lr_scheduler.load_state_dict(state["lr_scheduler"])
        scaler.load_state_dict(state["scaler"])
        if ema is not None and state["ema"] is not None:
            ema.load_state_dict(state["ema"])
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as e:
        raise UserError(
            f"trainer.resume: the checkpoint {state.get('path', '')} does not fit this run "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); resume with the config it was "
            "trained with, or start a new run folder"
        ) from None


# -- the teacher a checkpoint was trained against ---------------------------------------------------------------
TEACHER_SHAPE = ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim", "text_dim", "in_channels")
OTHER_TEACHER_FIX = {
    "resume": "resume with the teacher the run was trained with (or add trainer.allow_other_teacher=true to go on "
    "with this one on purpose)",
    "cli": "give the teacher the run was trained with (--teacher-path DIR), or add --allow-other-teacher to use this "
    "one on purpose",
    "export": "give the teacher the run was trained with (--teacher-path DIR, --teacher-lora FILE ...): an export "
    "ships the student with its teacher's parts, so it takes no other",
    "swapped": "its saved teacher.path or teacher.lora now hold other weights; put the teacher the run was trained "
    "with back there, or give it where it lies (--teacher-path DIR, --teacher-lora FILE ...): an export ships the "
    "student with its teacher's parts",
}


def teacher_record(spec, name: str) -> dict:
    """What a checkpoint records of its teacher: the name given (Hub id or folder), its shape, and a digest of
    its weights files (`teacher_digest`)."""
    config = spec.transformer_config
    record = {
        "name": str(name),
        "shape": {k: config.get(k) for k in TEACHER_SHAPE},
        "experts": len(spec.experts),
        "digest": teacher_digest(spec),
        "tensors_digest": tensors_digest(spec),
    }
    return record | ({"loras": lora_records(spec.loras)} if spec.loras else {})


def teacher_digest(spec, samples: int = 8, chunk: int = 4096) -> str:
    """A cheap fingerprint of the teacher's weights: per expert's safetensors file its name, size, header and
    `samples` chunks of its data at evenly spaced offsets (a few MB read for a 28 GB teacher, not a full hash).
    Two downloads of one model agree; another model, dtype or fine-tune differs. A moved folder keeps it."""

    h = hashlib.sha256()
    for f, size, n, _ in _weights_files(spec, h):
        start, data = 8 + n, size - 8 - n
        for i in range(samples):
            f.seek(start + max(data - chunk, 0) * i // (samples - 1))
            h.update(f.read(chunk))
    if spec.loras:  # a fine-tuned teacher (teacher.lora) is another teacher; a plain one's digest is as before
        h.update(json.dumps(stamp(spec.loras)).encode())
    return h.hexdigest()[:32]


def _weights_files(spec, h):
    """Each expert's safetensors file of `spec`, in order, open: (the file, its size, its header's length, the
    header's bytes: at most 100 MB), its name, size and header fed to `h` first (both digests start so)."""
    for expert in spec.experts:
        for file in sorted((Path(spec.path) / expert).glob("*.safetensors")):
            size = file.stat().st_size
            h.update(f"{expert}/{file.name}:{size}:".encode())
            with open(file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = f.read(min(n, 100 * 2**20))
                h.update(header)
                yield f, size, n, header


def tensors_digest(spec, chunk: int = 4096) -> str:
    """A fingerprint that sees every tensor: per expert's safetensors file its header, and of each tensor's bytes
    the first, middle and last `chunk` (all of a small one): ~12 KB a tensor, ~15 MB for a 14B expert's ~1,100.
    `teacher_digest`'s 8 samples a file miss a fine-tune of a few layers; this one does not. Recorded beside it
    (`tensors_digest`), and compared where a record holds it (runs of earlier versions hold `digest` alone)."""

    h = hashlib.sha256()
    for f, _, n, raw in _weights_files(spec, h):
        try:
            header = json.loads(raw)
        except ValueError:  # not a safetensors header: its bytes, hashed above, are what it is
            continue
        for name in sorted(k for k in header if k != "__metadata__"):
            begin, end = (8 + n + int(o) for o in header[name]["data_offsets"])
            size = end - begin
            at = [begin] if size <= 3 * chunk else [begin, begin + (size - chunk) // 2, end - chunk]
            for offset in at:
                f.seek(offset)
                h.update(f.read(min(size, chunk) if size > 3 * chunk else size))
    if spec.loras:
        h.update(json.dumps(stamp(spec.loras)).encode())
    return h.hexdigest()[:32]


def teacher_problem(recorded: dict | None, spec) -> str | None:
    """How the teacher `spec` differs from the one `recorded` (a checkpoint's `teacher`, or metrics.json's
    fields), in words; None if it is the same or nothing was recorded (a run of an earlier version)."""
    if not isinstance(recorded, dict):
        return None
    shape = recorded.get("shape")
    now = {k: spec.transformer_config.get(k) for k in TEACHER_SHAPE}
    if isinstance(shape, dict) and {k: shape.get(k) for k in TEACHER_SHAPE} != now:
        k = next(k for k in TEACHER_SHAPE if shape.get(k) != now[k])
        return (
            f"it was trained against {recorded.get('name', 'a teacher')!s:.200} with {k}={shape.get(k)}, this "
            f"teacher at {spec.path} has {k}={now.get(k)}"
        )
    loras, now_loras = recorded.get("loras") or [], lora_records(spec.loras)
    if isinstance(loras, list) and stamp_of(loras) != stamp_of(now_loras):
        return (
            f"it was trained against {recorded.get('name', 'a teacher')!s:.200} with teacher.lora="
            f"{lora_names(loras)}, and this run's is teacher.lora={lora_names(now_loras)}"
        )
    # Every tensor's fingerprint where recorded; a run of an earlier version's coarser one otherwise.
    fine = isinstance(recorded.get("tensors_digest"), str)
    digest = recorded.get("tensors_digest") if fine else recorded.get("digest")
    now_digest = (tensors_digest(spec) if fine else teacher_digest(spec)) if isinstance(digest, str) else None
    if isinstance(digest, str) and digest != now_digest:
        return (
            f"it was trained against {recorded.get('name', 'a teacher')!s:.200}, and the weights of the "
            f"teacher at {spec.path} differ (digest {str(now_digest)[:12]}, recorded {digest:.12})"
        )
    return None


def stamp_of(records: list) -> list:
    """The LoRAs' content, strengths and experts, from their records (a checkpoint's, or now)."""
    return [[r.get("sha256"), r.get("strength"), r.get("experts")] for r in records if isinstance(r, dict)]


def lora_names(records: list) -> str:
    """`[style.safetensors@0.8 (sha256 1a2b3c4d5e6f)]`, or `null`."""
    shown = [f"{r.get('file')}@{r.get('strength')} (sha256 {str(r.get('sha256'))[:12]})" for r in records]
    return f"[{', '.join(shown)}]" if shown else "null"


def _recorded_teacher(checkpoint: Path):
    """The teacher a checkpoint records (`teacher_problem`'s `recorded`); None for a state that cannot be read
    (`problem` refuses that one)."""
    try:
        return _read_state(Path(checkpoint)).get("teacher")
    except (OSError, ValueError, AttributeError, UserError):
        return None


def records_teacher(checkpoint: Path) -> bool:
    """Whether a checkpoint records the weights it was trained against (their digest): what lets a resume find its
    teacher at another place (`job/resumed.py`), held to that record by `check_teacher`."""
    recorded = _recorded_teacher(checkpoint)
    return isinstance(recorded, dict) and isinstance(recorded.get("digest"), str)


def adapters_problem(experts: int | None, shape, spec) -> str | None:
    """Why adapters trained on a teacher of `experts` experts and `shape` (its TEACHER_SHAPE record; None: not
    recorded) cannot go on the teacher `spec`, in words: one set per expert, each shaped by its layers, so another
    count of experts or another shape leaves layers without adapters or adapters without layers, whatever other
    weights may be allowed. None where they fit."""
    now, path, here = spec.transformer_config, spec.path, len(spec.experts)
    if isinstance(experts, int) and experts != here:
        return f"it holds adapters for {experts} expert(s) (one set per expert), and the teacher at {path} has {here}"
    if not isinstance(shape, dict):
        return None
    # in_channels is the layout's (state/runs.py layout_problem): adapters sit in the blocks, not the patch embedding
    k = next((k for k in TEACHER_SHAPE if k != "in_channels" and shape.get(k) != now.get(k)), None)
    if k is None:
        return None
    return f"its adapters were trained on a teacher with {k}={shape[k]}, and the teacher at {path} has {k}={now.get(k)}"


LAYOUT_WORDS = {Layout.t2v: "text-to-video", Layout.i2v: "image-to-video", Layout.ti2v: "TI2V"}


def layout_problem(recorded: dict | None, spec) -> str | None:
    """How the teacher `spec`'s layout (its experts' input channels: the noise alone, or with a mask and the image's
    latents) differs from the one a student was trained on (`recorded`: a checkpoint's or a run's teacher record),
    in words: a student runs only on its own, which no allowed other teacher bridges. None where it is the same or
    nothing was recorded."""
    shape = recorded.get("shape") if isinstance(recorded, dict) else None
    given, now = (shape.get("in_channels") if isinstance(shape, dict) else None), spec.transformer_config["in_channels"]
    if not isinstance(given, int) or given == now:
        return None
    name = recorded.get("name") if isinstance(recorded, dict) and isinstance(recorded.get("name"), str) else None
    return (
        f"it was trained on {name or 'its teacher'!s:.200}, whose experts take {given} input channels, and the teacher "
        f"at {spec.path} is {LAYOUT_WORDS[spec.layout]} (its experts take {now}): a student runs only on the layout it "
        "was trained on"
    )


def check_teacher(checkpoint: Path | None, spec, allow: bool, per_expert: bool = False) -> None:
    """A resume refuses, in one line, a teacher other than the one its checkpoint was trained against. `allow`
    (trainer.allow_other_teacher) takes another teacher on purpose, but not one of another layout (`layout_problem`:
    the student's inputs, and the run's data source, are its layout's), nor, for a student with one part per expert
    (`per_expert`: a LoRA student's adapter sets), another count of experts or another shape (`adapters_problem`):
    that checkpoint cannot be loaded, so those lines offer no flag."""
    if checkpoint is None:
        return
    recorded = _recorded_teacher(checkpoint)
    why = layout_problem(recorded, spec)
    if why:  # the flag would only meet the data source's refusal, whose fix (another source) a resume cannot take
        raise UserError(
            f"trainer.resume: the checkpoint {checkpoint} cannot go on this teacher: {why}; resume under the teacher "
            "it was trained with, or start a new run folder to distil this one"
        )
    if per_expert and isinstance(recorded, dict):
        why = adapters_problem(recorded.get("experts"), recorded.get("shape"), spec)
        if why:
            raise UserError(
                f"trainer.resume: the checkpoint {checkpoint} cannot go on this teacher: {why}; resume under the "
                f"teacher it was trained with ({recorded.get('name', 'its teacher')!s:.200}), or start a new run folder"
            )
    if allow:
        return
    why = teacher_problem(recorded, spec)
    if why:
        raise UserError(
            f"trainer.resume: the checkpoint {checkpoint} does not fit this teacher: {why}; "
            f"{OTHER_TEACHER_FIX['resume']}"
        )


# -- the method a checkpoint was trained with ---------------------------------------------------------------------
def method_problem(recorded: dict | None, identity: dict) -> str | None:
    """How this run's method (`identity`: `Method.identity()`, its name and the `method.<key>`s that change what it
    trains) differs from the one a checkpoint `recorded`, in words; None if it is the same, or nothing was recorded
    (a checkpoint of an earlier version)."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("name"), str) or recorded == identity:
        return None
    name, now = recorded["name"], identity.get("name")
    settings = ", ".join(f"method.{k}={v!s:.100}" for k, v in recorded.items() if k != "name" and v is not None)
    trained = f"method={name:.100}" + (f" ({settings})" if settings else "")
    if name != now:
        return f"was trained with {trained}, and this run's is method={now}"
    differ = [k for k in identity if k != "name" and identity.get(k) != recorded.get(k)]
    differ += [k for k in recorded if k not in identity]
    shown = ", ".join(f"method.{k}={identity.get(k)}" for k in differ)
    return f"was trained with {trained}, and this run sets {shown}"


def recorded_method(checkpoint: Path) -> dict | None:
    """The method a checkpoint records it was trained with (`Method.identity()`), or None: none recorded (an
    earlier version's), or a state that cannot be read (`problem` refuses that one)."""
    try:  # as written (a setting that is a tuple comes back one)
        recorded = safestate.decode(_read_state(Path(checkpoint)).get("method_identity"), {})
    except (OSError, ValueError, AttributeError, TypeError, UserError):
        return None
    return recorded if isinstance(recorded, dict) and isinstance(recorded.get("name"), str) else None


def check_method(checkpoint: Path | None, identity: dict, resume: str | None) -> None:
    """A resume refuses, in one line, a method other than the one its checkpoint was trained with (another name,
    or other settings of the keys its class names): its other networks would be dropped, or would not load."""
    if checkpoint is None:
        return
    why = method_problem(recorded_method(checkpoint), identity)
    if why:
        named = "" if resume and Path(resume).expanduser() == Path(checkpoint) else f" {checkpoint}"
        raise UserError(
            f"trainer.resume={resume}: the checkpoint{named} {why}; resume with those, or start a new "
            f"run folder{_student_of(Path(checkpoint))}"
        )


def _student_of(checkpoint: Path) -> str:
    """How a new run starts from a checkpoint's student: its run's final student, or that checkpoint exported
    (where it lies in a run folder under a name the export takes); nothing where neither is at hand."""
    run = checkpoint.parent.parent
    if (run / "student" / "config.json").is_file():
        return f" from its student (student.init={run / 'student'})"
    if not (run / ".hydra" / "config.yaml").is_file() or not re.fullmatch(r"step_\d+|best", checkpoint.name):
        return ""
    return (
        f" from its student (python -m wandistiller.pipeline {run} --checkpoint {checkpoint.name} --out DIR "
        f"exports it; then student.init=DIR/transformer)"
    )


# -- the student a checkpoint holds (a LoRA student's rank, alpha and layers) ------------------------------------
def check_student_identity(checkpoint: Path | None, identity: dict | None, resume: str | None) -> None:
    """A resume refuses, in one line, a LoRA student of another rank, alpha or set of layers than its checkpoint's
    (`LoraStudent.identity`, recorded as `student_identity`), or a LoRA checkpoint resumed as another student (or
    the reverse): its adapters would not load, or would load into other layers."""
    if checkpoint is None:
        return
    try:
        recorded = safestate.decode(_read_state(Path(checkpoint)).get("student_identity"), {})
    except (OSError, ValueError, AttributeError, TypeError, UserError):
        return  # an unreadable state: `problem` refused it already
    if recorded == identity or (recorded is None and identity is None):
        return
    show = lambda ident: (
        "student=lora " + ", ".join(f"student.{k}={ident[k]}" for k in ("rank", "alpha", "layers") if k in ident)
        if isinstance(ident, dict)
        else "a student of its own (not student=lora)"
    )
    named = "" if resume and Path(resume).expanduser() == Path(checkpoint) else f" {checkpoint}"
    raise UserError(
        f"trainer.resume={resume}: the checkpoint{named} holds {show(recorded)}, and this run's is "
        f"{show(identity)}; resume with those, or start a new run folder"
    )
