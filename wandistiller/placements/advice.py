"""What the planner tells the user: the plan's report, and where nothing fits, what to change (a smaller batch, fewer
frames, other hardware) -- each fix tried on paper with the planner before it is said."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

from wandistiller.core.arch import rope_table
from wandistiller.placements import Placement
from wandistiller.placements.memory import (
    DEFAULT_HEADROOM_FRACTION,
    GiB,
    Hardware,
    Workload,
    teacher_weight_bytes,
)
from wandistiller.placements.planner import (
    choose,
    describe_student,
    format_table,
    method_lines,
    plan,
    shortages,
    step_times,
    text_encoder_line,
)
from wandistiller.placements.steptime import Passes
from wandistiller.teacher.spec import read_json


def plan_report(
    w: Workload,
    hw: Hardware,
    teacher: str,
    passes: Passes,
    precision: str = "",
    configured: Placement | None = None,
    clip: tuple[int, int] | None = None,
    text_encoder: int | None = None,
) -> str:
    """The plan's text: the workload (`teacher`: its name), the method's own network and passes (`passes`: the built
    method's), each placement's estimate and step time, and `auto`'s choice. `precision`: the line saying which
    precision the figures are at (and why, for precision=auto). `configured`: the placement asked for, planned
    with its own settings (e.g. `teacher_placement.resident_blocks=0`), as `plan` takes it. `clip`: (latent
    frames, the VAE's time factor) of a clip run, which adds the line of the largest latent_frames that fits."""
    estimates = plan(w, hw, configured)
    times = step_times(estimates, w, hw, passes, configured)
    best = choose(estimates, times)
    head = (
        f"teacher {teacher}: {w.experts} expert(s), {teacher_weight_bytes(w) / GiB:.1f} GiB of weights; "
        f"student {describe_student(w)}; batch {w.batch_size} x {w.tokens} tokens"
    )
    asked = configured.name if configured is not None else None
    table = format_table(estimates, hw, best.placement if best else None, w, times, asked)
    fix = fixes_line(w, hw, configured)
    frames = [frames_line(w, hw, *clip, configured)] if clip and clip[0] > 1 else []
    # "use more memory" where a smaller batch or fewer frames fit contradicted the lines beside it
    what = "see what would, above" if fix else "see the frames that would, below" if frames else ""
    tail = f"auto would choose: {best.placement}" if best else f"nothing fits as asked: {what or 'use more memory'}"
    encoder = text_encoder_line(text_encoder, hw)
    lines = [head, *method_lines(w, passes), *([precision] if precision else []), table, *fix]
    return "\n".join([*lines, *([encoder] if encoder else []), tail, *frames])


def _fits(w: Workload, hw: Hardware, configured: Placement | None) -> bool:
    """Whether the asked run fits: under `configured` (with its settings), or under any placement (auto)."""
    estimates = plan(w, hw, configured)
    return any(e.fits for e in estimates if configured is None or e.placement == configured.name)


def fixes(w: Workload, hw: Hardware, configured: Placement | None = None) -> list[str]:
    """For a run that does not fit (under `configured`, or any placement where it is None): the overrides that
    each alone would make it fit, the largest setting first: fewer resident blocks (a placement given a count),
    a smaller trainer.batch_size, teacher.quantize=fp8. Fewer frames is `frames_line`'s.
    Empty where it fits, or where `configured` is refused outright (its note says why)."""
    if _fits(w, hw, configured):
        return []
    if configured is not None:
        mine = next(e for e in plan(w, hw, configured) if e.placement == configured.name)
        if not (mine.gpu_bytes or mine.host_bytes):
            return []
    found = []
    asked = getattr(configured, "resident_blocks", "auto")
    if asked != "auto" and int(asked) > 0:
        fewer = copy.copy(configured)
        for k in range(int(asked) - 1, -1, -1):
            fewer.resident_blocks = k  # type: ignore[union-attr]
            if _fits(w, hw, fewer):
                found.append(f"teacher_placement.resident_blocks={k}")
                break
    smaller = largest_batch(w, hw, configured)
    if smaller:
        found.append(f"trainer.batch_size={smaller}")
    if not w.teacher_fp8 and _fits(dataclasses.replace(w, teacher_fp8=True), hw, configured):
        found.append("teacher.quantize=fp8")
    if found:
        return found
    together, least = [], w  # no one of them alone: all of them at once
    if asked != "auto" and int(asked) > 0:
        configured = copy.copy(configured)
        configured.resident_blocks, together = 0, ["teacher_placement.resident_blocks=0"]  # type: ignore[union-attr]
    if w.batch_size > 1:
        least, together = _at_batch(least, 1), [*together, "trainer.batch_size=1"]
    if not w.teacher_fp8:
        least, together = dataclasses.replace(least, teacher_fp8=True), [*together, "teacher.quantize=fp8"]
    return [" ".join(together)] if len(together) > 1 and _fits(least, hw, configured) else []


def largest_batch(w: Workload, hw: Hardware, configured: Placement | None = None) -> int | None:
    """The largest trainer.batch_size under `w`'s that fits (memory grows with the batch: a bisection, where counting
    down from trainer.batch_size=100000 planned for 16 s, and from 1e8 for hours); None where batch 1 does not."""
    if w.batch_size <= 1 or not _fits(_at_batch(w, 1), hw, configured):
        return None
    fits, too_big = 1, w.batch_size
    while too_big - fits > 1:
        middle = (fits + too_big) // 2
        fits, too_big = (middle, too_big) if _fits(_at_batch(w, middle), hw, configured) else (fits, middle)
    return fits


def _at_batch(w: Workload, batch: int) -> Workload:
    """`w` at another per-rank batch (a teacher call's batch scaled with it)."""
    teacher = (w.teacher_batch_size or w.batch_size) * batch // w.batch_size
    return dataclasses.replace(w, batch_size=batch, teacher_batch_size=max(teacher, batch))


def fixes_line(w: Workload, hw: Hardware, configured: Placement | None = None) -> list[str]:
    """The plan's line naming what would make a run that does not fit, fit (none where nothing of that does)."""
    found = fixes(w, hw, configured)
    where = f"teacher_placement={configured.name}" if configured is not None else "this run"
    if not found:
        return []
    if " " in found[0]:  # overrides that fit only together
        return [f"{where} would fit with all of: {found[0]}"]
    return [f"{where} would fit with any one of: {', or '.join(found)}"]


def nothing_fits(w: Workload, hw: Hardware, frames: int) -> str | None:
    """Where no setting fits this hardware -- under any placement, at batch 1, one latent frame, and an fp8 teacher
    (offload/disk then keep only the blocks that fit) -- what is short and by how much, from
    the placement short of least; None where some setting fits."""
    least = dataclasses.replace(_at_frames(_at_batch(w, 1), frames, 1), teacher_fp8=True)
    estimates = [e for e in plan(least, hw) if e.gpu_bytes or e.host_bytes]
    if any(e.fits for e in estimates) or not estimates:
        return None
    short = {e.placement: shortages(e, hw) for e in estimates}
    name = min(short, key=lambda n: sum(m for _, m, _ in short[n]))
    missing = " and ".join(f"{m / GiB:.1f} GiB of {d} ({u / GiB:.1f} usable)" for d, m, u in short[name])
    # The headroom left free is the user's setting: where it is what is short, lowering it is the fix (an audit's
    # hardware.headroom_gib=100 on an 80 GiB GPU was told to buy more memory). Said where the defaults would fit.
    raised = [f"hardware.headroom_gib={hw.headroom_gib:g}"] if hw.headroom_gib > 0 else []
    if hw.headroom_fraction > DEFAULT_HEADROOM_FRACTION:
        raised.append(f"hardware.headroom_fraction={hw.headroom_fraction:g}")
    defaults = dataclasses.replace(hw, headroom_gib=0.0, headroom_fraction=DEFAULT_HEADROOM_FRACTION)
    fix = (
        f"lower {' and '.join(raised)} (memory left free), or use a GPU or host with more memory"
        if raised and any(e.fits for e in plan(least, defaults))
        else "use a GPU or host with that much more memory"
    )
    return (
        f"no setting fits {hw.describe()}, not even trainer.batch_size=1 data.latent_frames=1"
        + (" teacher.quantize=fp8" if least.teacher_fp8 else "")
        + f": the closest, teacher_placement={name}, is short of {missing}; {fix}"
    )


MOST_FRAMES = 1024  # latent frames searched at most (job/checks.py's MAX_LATENT): Wan's rope table covers 1024


def rope_frames(w: Workload) -> tuple[int, str]:
    """The most latent frames the student's and the teacher's rope tables cover, as train checks them (job/
    preflight.py's check_rope: rope_max_seq_len patches of the student's patch size in time), and whose table that
    is, e.g. "the teacher's rope table (rope_max_seq_len=32)"; the teacher's on a tie, as check_rope names it."""
    p = int((w.student_config.get("patch_size") or (1, 2, 2))[0])
    who, rope = rope_table(w.student_config, w.teacher_config)
    return rope * p, f"the {who}'s rope table (rope_max_seq_len={rope})"


def _at_frames(w: Workload, frames: int, f: int) -> Workload:
    """`w` (`w.tokens` are `frames` latent frames' worth) at `f` latent frames, the same height and width."""
    pt = int((w.teacher_config.get("patch_size") or [1, 2, 2])[0])
    per_step = max(w.tokens // max(frames // pt, 1), 1)  # tokens per patch of time (one latent frame for Wan)
    return dataclasses.replace(w, tokens=max(f // pt, 1) * per_step)


def largest_frames(
    w: Workload, hw: Hardware, frames: int, configured: Placement | None = None, most: int | None = None
) -> int:
    """The most latent frames a run of `w`'s shape fits at its height and width (`w.tokens` are `frames`' worth)
    and train takes (no more than `most`: by default MOST_FRAMES, or fewer where the rope tables cover fewer:
    `rope_frames`): under `configured`, or any placement where it is None (auto); 0 where not even one frame fits.
    Memory grows with tokens, so a bisection finds it."""
    most = most if most is not None else min(MOST_FRAMES, rope_frames(w)[0])

    def fits(f: int) -> bool:
        estimates = plan(_at_frames(w, frames, f), hw, configured)
        return any(e.fits for e in estimates if configured is None or e.placement == configured.name)

    if fits(most):
        return most
    low, high = 0, most - 1  # fits(low) (0: nothing yet); not fits(high + 1)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def time_factor(teacher_path: str) -> int:
    """Frames per latent frame of the teacher's VAE (its vae/config.json's scale_factor_temporal), or Wan's 4 for
    a teacher not on disk (a Hub id planned on paper: every Wan 2.1/2.2 VAE compresses time 4x)."""
    config = Path(str(teacher_path)).expanduser() / "vae" / "config.json"
    return int(read_json(config, "teacher.path").get("scale_factor_temporal", 4)) if config.is_file() else 4


def largest_frames_line(w: Workload, hw: Hardware, frames: int, time_factor: int) -> str | None:
    """A train refusal's words for a clip that fits no placement here: the largest latent_frames that does
    (None where not even one frame fits: the usual refusal then says what to do)."""
    n = largest_frames(w, hw, frames)
    if n == 0 or n >= frames:
        return None
    return (
        f"data.latent_frames={frames} is more frames than fit ({hw.describe()}): the largest latent_frames that "
        f"fits: {n} (= {(n - 1) * time_factor + 1} frames) at batch {w.batch_size} and this frame size; use "
        f"data.latent_frames<={n}, a smaller trainer.batch_size or more memory (python -m wandistiller.plan)"
    )


def frames_line(w: Workload, hw: Hardware, frames: int, time_factor: int, configured: Placement | None = None) -> str:
    """The plan's line for a clip (`frames` latent frames > 1): the largest latent_frames that fits on this hardware
    and that the rope tables cover (saying so where they, not memory, are the limit), and under `configured`, the
    placement asked for, where that is less; in frames of the VAE's."""
    n = largest_frames(w, hw, frames)
    if n == 0:
        return "the largest latent_frames that fits: none (not even 1 latent frame fits this hardware)"
    fitting = [e.placement for e in plan(_at_frames(w, frames, n), hw, configured) if e.fits]
    rope, table = rope_frames(w)
    bound = f", the limit of {table}, not of memory" if n == rope else ""
    verdict = "fits" if n >= frames else f"does not: use data.latent_frames<={n}"
    line = (
        f"the largest latent_frames that fits: {n} (= {(n - 1) * time_factor + 1} frames) at batch {w.batch_size} "
        f"and this frame size ({', '.join(fitting)}){bound}; data.latent_frames={frames} {verdict}"
    )
    if configured is not None and configured.name not in fitting:
        mine = largest_frames(w, hw, frames, configured)
        line += f"; teacher_placement={configured.name}: " + (f"at most {mine}" if mine else "not even 1")
    return line
