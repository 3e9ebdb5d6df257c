"""The frozen facts one process of a run works from, settled before its first `_setup_*` step: what data
sources, outputs and hooks take in place of the whole recipe. Runtime objects that change while a run sets up
(the teacher, embeddings, the student) are never in it: each step is given those explicitly."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig

from wandistiller.core.distributed import Roles, Topology
from wandistiller.core.precision import Precision
from wandistiller.placements.base import Placement
from wandistiller.recipe.methods.base import Method
from wandistiller.teacher.fewstep import Schedule
from wandistiller.teacher.spec import TeacherSpec


@dataclass(frozen=True)
class Prepared:
    """What the job settled before any worker starts (picklable: it travels to spawned workers). What it built and
    read is handed down, not built or read again: the method, the teacher's spec, the student's config."""

    run_dir: str
    teacher_path: str
    placement: Placement  # built once; `auto` already resolved
    resume_from: str | None
    plan_table: str | None
    method: Method  # built from `cfg.method` and checked (not yet prepared nor bound)
    spec: TeacherSpec  # the teacher folder, inspected
    student_config: dict  # the student's WanTransformer3DModel config, checked against the teacher's (check_student)
    sweep_point: dict | None = None  # group, name, overrides, choices: when this run is one point of a sweep
    overrides: list[str] | None = None  # the command line's (a resume's added to the first run's), for metrics.json
    resume_config: str | None = None  # a resume's own .hydra/config_resume_<time>.yaml: gone if setup refuses it


@dataclass(frozen=True)
class RunContext:
    # Config sub-nodes (DictConfig): read, never written.
    teacher_cfg: DictConfig
    data_cfg: DictConfig
    trainer_cfg: DictConfig
    student_cfg: DictConfig
    seed: int
    cache_dir: str
    spec: TeacherSpec  # the teacher's
    placement: Placement  # its placement, `auto` resolved
    topo: Topology
    roles: Roles
    precision: Precision
    device: torch.device  # where this rank computes
    run_dir: Path
    teacher_path: str
    sweep_point: dict | None = None
    overrides: list[str] | None = None
    # A few-step student's K (`method.steps`; None: it samples as the teacher does) and the sigmas it is trained at
    # (`method.schedule`; None: diffusers' Euler at K): every draw of the student during the run samples at those.
    student_steps: int | None = None
    student_schedule: Schedule | None = None
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
        # The noise's channels (out_channels): an I2V expert's in_channels also count its mask and image latents.
        return (self.spec.latent_channels, d.latent_frames, d.latent_height, d.latent_width)
