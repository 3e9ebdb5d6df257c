"""A finished (or running) run folder, read back: its config, its teacher, a chosen student, and both
sampling through WanPipeline -- the pieces `wandistiller.eval` and `wandistiller.generate` share.

The student is a WanTransformer3DModel, so it drops into WanPipeline in the teacher's place; it was
trained on guided targets, so it samples without CFG (guidance 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from wandistiller.core.errors import UserError
from wandistiller.core.files import safetensors_problem
from wandistiller.core.precision import cast_keeping_fp32
from wandistiller.core.renamed import modernize
from wandistiller.data.latents import SamplerSettings, noise_for, sample_latents, teacher_pipeline
from wandistiller.state.checkpoint import STATE_FILE, checkpoint_dir, list_checkpoints, load_checkpoint
from wandistiller.teacher.model import Teacher, TeacherSpec, inspect_teacher, resolve_teacher_path


@dataclass
class RunFolder:
    path: Path
    cfg: DictConfig
    spec: TeacherSpec

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        d = self.cfg.data
        return (self.spec.transformer_config["in_channels"], d.latent_frames, d.latent_height, d.latent_width)


def open_run(path: str | Path, teacher_path: str | None = None) -> RunFolder:
    """A run folder (it holds `.hydra/config.yaml`); its teacher found from `teacher.path`, interpolated."""
    from wandistiller.config import register_configs

    register_configs()  # the resolvers a saved config may use
    path = Path(path).expanduser()
    config = path / ".hydra" / "config.yaml"
    if not config.is_file():
        raise UserError(f"{path} is not a run folder (no .hydra/config.yaml); give an outputs/<date>/<time> folder")
    try:
        cfg = OmegaConf.load(config)
    except Exception as e:  # YAML's own errors, an unreadable file: the run folder is damaged either way
        raise UserError(f"{config} cannot be read ({type(e).__name__}); restore it from the run's backup") from None
    modernize(cfg)  # an older run's `_target_`s name today's modules
    if teacher_path is not None:
        cfg.teacher.path, cfg.teacher.builtin = teacher_path, None
    return RunFolder(path, cfg, inspect_teacher(resolve_teacher_path(cfg.teacher, cfg.paths.cache_dir)))


def student_source(run: RunFolder, checkpoint: str | None) -> Path:
    """The folder a student comes from: `<run>/student` (the final one), or a checkpoint by name."""
    checkpoints = list_checkpoints(run.path)
    if checkpoint is None:
        found = run.path / "student" if (run.path / "student").is_dir() else None
        found = found or (checkpoints[-1] if checkpoints else None)
    elif checkpoint == "latest":
        found = checkpoints[-1] if checkpoints else None
    elif checkpoint == "best":
        found = run.path / "checkpoints" / "best"
    elif checkpoint.startswith("step_") and checkpoint[5:].isdigit():
        found = checkpoint_dir(run.path, int(checkpoint[5:]))
    else:
        raise UserError(f"--checkpoint {checkpoint!r} is not best, latest or step_N")
    if found is None or not (found.name == "student" or (found / STATE_FILE).is_file()):
        have = ", ".join(p.name for p in checkpoints) or "none"
        what = "no student yet" if checkpoint is None else f"no checkpoint {checkpoint!r}"
        raise UserError(f"{run.path} has {what} (checkpoints: {have}); train it first or pick another --checkpoint")
    return found


def load_student(run: RunFolder, source: Path, device: torch.device, dtype: torch.dtype = torch.float32):
    """The student's WanTransformer3DModel, from a saved folder or a checkpoint's training state."""
    from diffusers import WanTransformer3DModel
    from hydra.utils import instantiate

    if (source / "config.json").is_file():
        for file in sorted(source.glob("*.safetensors")):  # a damaged file is one line, not diffusers' traceback
            problem = safetensors_problem(file)
            if problem:
                raise UserError(f"the student in {source}: {problem}; use --checkpoint latest (or another)")
        transformer = WanTransformer3DModel.from_pretrained(source, dtype=dtype, use_safetensors=True)
    else:
        student = instantiate(run.cfg.student, _partial_=True)(spec=run.spec)
        student.load_state_dict(load_checkpoint(source)["student"])  # safetensors + JSON: never unpickles
        transformer = cast_keeping_fp32(student.transformer, dtype)
    return transformer.to(device).eval().requires_grad_(False)


def load_teacher(run: RunFolder, device: torch.device, dtype: torch.dtype) -> Teacher:
    """The whole teacher on one device, with the run's guidance scales: what teacher_placement=cpu/gpu load."""
    from wandistiller.placements.base import load_teacher as load_whole

    return load_whole(run.spec, run.cfg.teacher, dtype, device)


def as_sampler(spec: TeacherSpec, transformer, device: torch.device) -> Teacher:
    """The student in the teacher's place: one expert, no CFG."""
    return Teacher(spec, [transformer], [1.0], device)


def generate(sampler: Teacher, embeddings, prompt_idx: list[int], seed: int, steps: int, shape) -> tuple:
    """(latents [N, C, F, H, W], seconds per image) from `noise_for(seed, i, 0, stream="eval")` per prompt.

    One image per pipeline call, so the seconds are per image; a 1-step call first pays the warm-up.
    """
    pipe = teacher_pipeline(sampler)
    settings = SamplerSettings(steps, tuple(sampler.guidance_scales), tuple(shape))
    out, seconds = [], []
    for n, i in enumerate(prompt_idx):
        noise = noise_for(seed, i, 0, tuple(shape), stream="eval")[None].to(sampler.device)
        cond = embeddings.padded(torch.tensor([i])).to(sampler.device, sampler.dtype)
        uncond = embeddings.negative_batch(1).contiguous().to(sampler.device, sampler.dtype)
        if n == 0:
            sample_latents(
                pipe, noise, cond, uncond, SamplerSettings(1, settings.guidance_scales, settings.latent_shape)
            )
        start = time.perf_counter()
        out.append(sample_latents(pipe, noise, cond, uncond, settings))
        if sampler.device.type == "cuda":
            torch.cuda.synchronize(sampler.device)
        seconds.append(time.perf_counter() - start)
    return torch.cat(out), seconds
