"""Training on clips (data.latent_frames > 1): every method (kd, trajectory, dmd with its fake score, full or
LoRA) and every student kind (a cut `half`, a LoRA on the teacher; one expert and a pair) trains a few real steps
on the tiny teacher (its VAE compresses time 4x) at 3 latent frames, validation included; the teacher's own clips
(data=teacher_latents) are cached as [C, 3, h, w] latents and trained on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.conftest import metrics_steps
from wandistiller.data.latents import load_latent_bank
from wandistiller.train import run

CLIP = ["data.latent_frames=3", "trainer.max_steps=2", "trainer.batch_size=2", "trainer.log_every=1"]
DMD = ["method=dmd", "method.steps=2", "method.fake_updates=1"]
RUNS = {
    "kd_cut_half": ["student=half", "hooks.monitor.val_every=1"],
    "dmd_tiny": DMD,
    "dmd_half_lora_fake_score": ["student=half", *DMD, "method.fake_score=lora"],
    "lora_dmd_pair": ["teacher=tiny_moe", "student=lora", *DMD, "method.fake_score=lora"],
    "lora_kd": ["student=lora"],
}


def _finite_losses(folder: Path) -> list[float]:
    losses = [r["loss"] for r in metrics_steps(folder) if "loss" in r]
    assert losses and all(math.isfinite(x) for x in losses)
    return losses


@pytest.mark.parametrize("name", list(RUNS))
def test_trains_on_clips(make_cfg, tmp_path, name):
    folder = tmp_path / name
    run(make_cfg(*CLIP, *RUNS[name], run_dir=folder))
    assert len(_finite_losses(folder)) == 2
    assert (folder / "student").is_dir() or (folder / "checkpoints").is_dir()


@pytest.mark.slow
def test_trajectory_on_clips(make_cfg, tmp_path):
    folder = tmp_path / "trajectory"
    run(make_cfg(*CLIP, "method=trajectory", "method.steps=2", "method.teacher_steps=4", run_dir=folder))
    assert len(_finite_losses(folder)) == 2


def test_trains_on_teacher_clips(make_cfg, tmp_path, cache_dir):
    """The teacher's own clips: sampled at 3 latent frames (9 frames through its VAE), cached, trained on."""
    folder = tmp_path / "teacher_clips"
    overrides = ["data=teacher_latents", "data.sample_steps=2", "data.prompts_path=" + str(_prompts(tmp_path))]
    run(make_cfg(*CLIP, *overrides, run_dir=folder))
    assert len(_finite_losses(folder)) == 2
    banks = [load_latent_bank(p) for p in (cache_dir / "teacher_latents").iterdir()]
    shapes = {b.latent_shape for b in banks if b is not None}
    assert (16, 3, 8, 8) in shapes
    bank = next(b for b in banks if b is not None and b.latent_shape == (16, 3, 8, 8))
    x0 = bank.x0(torch.arange(len(bank)))
    assert torch.isfinite(x0).all() and not torch.equal(x0[:, :, 0], x0[:, :, 2])  # frames differ: a clip


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("a red ball\na blue cube\na green cat\na small dog\n")
    return path
