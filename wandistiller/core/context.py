"""The frozen facts one process of a run works from, settled before its first `_setup_*` step: what data
sources, outputs and hooks take in place of the whole recipe. Runtime objects that change while a run sets up
(the teacher, embeddings, the student) are never in it: each step is given those explicitly."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from wandistiller.core.distributed import Roles, Topology


@dataclass(frozen=True)
class RunContext:
    # Config sub-nodes (DictConfig): read, never written.
    teacher_cfg: object
    data_cfg: object
    trainer_cfg: object
    student_cfg: object
    seed: int
    cache_dir: str
    spec: object  # the teacher's TeacherSpec (wandistiller.teacher.spec)
    placement: object  # its Placement, `auto` resolved (wandistiller.placements)
    topo: Topology
    roles: Roles
    precision: object  # wandistiller.core.precision.Precision
    device: torch.device  # where this rank computes
    run_dir: Path
    teacher_path: str
    sweep_point: dict | None = None
    overrides: list[str] | None = None
    started: float = field(default_factory=time.time)

    @property
    def is_main(self) -> bool:
        return self.topo.rank == self.roles.main

    @property
    def makes_teacher_data(self) -> bool:
        """Whether this rank makes what needs the teacher (latents, held-out targets, sample grids): rank 0,
        which always holds one, or every rank of a teacher whose forwards are collectives."""
        return self.roles.has_teacher and (self.topo.rank == 0 or self.placement.collective)

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        d = self.data_cfg
        return (self.spec.transformer_config["in_channels"], d.latent_frames, d.latent_height, d.latent_width)
