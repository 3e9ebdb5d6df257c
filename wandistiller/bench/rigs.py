"""The table of rigs in docs/PLANNER.md: Wan 14B LoRA dmd on the one-GPU machines people own, each cell planned by
the planner (placements/planner.py) on paper. `python -m wandistiller.plan --rigs` prints it, `--rigs --write`
rewrites the section between the markers; tests/bench/test_rigs.py recomputes every documented cell."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from wandistiller.compose import register_configs
from wandistiller.core.errors import UserError, rate
from wandistiller.core.hydra import compose_config
from wandistiller.job.checks import method_passes, name_the_teacher
from wandistiller.placements.advice import largest_frames
from wandistiller.placements.memory import GiB, Hardware, Workload
from wandistiller.placements.offload import OffloadPlacement
from wandistiller.placements.planner import (
    choose,
    plan,
    shortages,
    step_times,
    workload_of,
)
from wandistiller.placements.steptime import Passes

DOC = Path(__file__).resolve().parents[2] / "docs" / "PLANNER.md"
BEGIN, END = "<!-- rigs: begin (python -m wandistiller.plan --rigs --write) -->", "<!-- rigs: end -->"
TEACHERS = {"wan2.1_t2v_14b": "Wan 2.1 14B", "wan2.2_t2v_a14b": "Wan 2.2 A14B pair"}
BASES = ("bf16", "fp8")
CLIPS = {1: "1 frame", 21: "81 frames"}  # latent frames -> frames of 480x832
GPUS, HOSTS = (12, 16, 24), (32, 64, 128)  # GiB
RUN = [
    "student=lora",
    "method=dmd",
    "method.fake_score=lora",
    "teacher_placement=offload",
    "precision=bf16",
    "trainer.batch_size=1",
    "data.latent_height=60",
    "data.latent_width=104",
]


def overrides(teacher: str, base: str, latent_frames: int) -> list[str]:
    fp8 = ["teacher.quantize=fp8"] if base == "fp8" else []
    return [f"teacher={teacher}", *RUN, f"data.latent_frames={latent_frames}", *fp8, "hardware.gpus=1",
            "hardware.gpu_memory_gib=24", "hardware.host_memory_gib=64"]  # fmt: skip


def workload(teacher: str, base: str, latent_frames: int) -> tuple[Workload, Passes]:
    """The planner's workload and the method's passes for one row's run (the hardware is set per cell)."""
    register_configs()
    cfg = compose_config(overrides(teacher, base, latent_frames))
    name_the_teacher(cfg)
    passes = method_passes(cfg)
    found = workload_of(cfg, torch.bfloat16, passes.networks)
    assert found is not None, "the public teachers' configs are known (core/arch.py KNOWN_TEACHERS)"
    return found[0], passes


def cell(w: Workload, passes: Passes, gpu_gib: int, host_gib: int, latent_frames: int) -> str:
    """One cell: `offload` (blocks kept per expert, s/step), else what auto takes instead, else what is short."""
    hw = Hardware((gpu_gib * GiB,), host_gib * GiB)
    offload = OffloadPlacement()
    estimates = plan(w, hw, offload)
    times = step_times(estimates, w, hw, passes, offload)
    blocks = w.teacher_config["num_layers"]
    mine = next(e for e in estimates if e.placement == "offload")
    if mine.fits:
        return f"yes {mine.resident_blocks}/{blocks}, {rate(times['offload'].seconds)} s"
    best = choose(estimates, times)
    if best is not None:
        kept = blocks if best.resident_blocks is None else best.resident_blocks  # gpu: the whole teacher
        return f"no; {best.placement} {kept}/{blocks}, {rate(times[best.placement].seconds)} s"
    # short by, in GiB rounded up (a 0.01 GiB miss reads 0.1, not 0.0)
    short = ", ".join(f"{d.replace(' RAM', '').replace(' 0', '')} -{math.ceil(m / GiB * 10) / 10:.1f}"
                      for d, m, _ in shortages(mine, hw))  # fmt: skip
    most = largest_frames(w, hw, latent_frames) if latent_frames > 1 else 0
    return f"no ({short} GiB)" + (f"; <={most} lf" if most else "")


def table() -> str:
    """The section's markdown: one row per teacher, base, clip and GPU; a column per host size."""
    head = f"| teacher | base | clip | GPU GiB | {' | '.join(f'host {h} GiB' for h in HOSTS)} |"
    lines = [head, "|" + "---|" * (4 + len(HOSTS))]
    for teacher, label in TEACHERS.items():
        for base in BASES:
            for frames, clip in CLIPS.items():
                w, passes = workload(teacher, base, frames)
                for gpu in GPUS:
                    cells = [cell(w, passes, gpu, host, frames) for host in HOSTS]
                    lines.append(f"| {label} | {base} | {clip} | {gpu} | {' | '.join(cells)} |")
    return "\n".join(lines)


def _markers(text: str) -> re.Match:
    match = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    if match is None:
        raise UserError(f"docs/PLANNER.md has no rig table between {BEGIN!r} and {END!r}; add the two markers")
    return match


def section(text: str) -> str:
    """The part of docs/PLANNER.md between the markers."""
    return _markers(text).group(1)


def write(doc: Path = DOC) -> None:
    text = doc.read_text()
    span = _markers(text).span(1)
    doc.write_text(text[: span[0]] + table() + "\n" + text[span[1] :])


ROW = re.compile(r"^\| (?P<label>[^|]+) \| (?P<base>bf16|fp8) \| (?P<clip>[^|]+) \| (?P<gpu>\d+) \|(?P<cells>.*)\|$")


def documented(doc: Path = DOC) -> dict[tuple[str, str, int, int, int], str]:
    """The documented cells: (teacher, base, latent frames, GPU GiB, host GiB) -> the cell's text."""
    teachers = {label: t for t, label in TEACHERS.items()}
    frames = {clip: f for f, clip in CLIPS.items()}
    cells = {}
    for line in section(doc.read_text()).splitlines():
        m = ROW.match(line)
        if m is None:
            continue
        row = [c.strip() for c in m["cells"].split("|")]
        for host, text in zip(HOSTS, row, strict=True):
            cells[teachers[m["label"]], m["base"], frames[m["clip"]], int(m["gpu"]), host] = text
    return cells
