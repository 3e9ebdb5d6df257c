"""wandistiller/data/validation.py: the held-out set, a deterministic val/loss per band, loss.png, directly."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from tests.conftest import FP32
from wandistiller.core.distributed import Topology
from wandistiller.core.errors import UserError
from wandistiller.data.prompts import encode_prompts, read_prompts
from wandistiller.data.validation import build_val_set, save_loss_plot, split_prompts, timestep_grid, val_loss
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.student.model import build_student
from wandistiller.teacher.spec import inspect_teacher

STUDENT = OmegaConf.create({"builder": "tiny", "config_path": None, "init": "random"})


def test_held_out_prompts_are_the_last_tenth_or_a_file_removed_from_training(tmp_path):
    prompts = [f"prompt {i}" for i in range(30)]
    train, val = split_prompts(prompts, None)
    assert val == prompts[-3:] and train == prompts[:-3]
    path = tmp_path / "val.txt"
    path.write_text("prompt 4\nsomething new\n")
    train, val = split_prompts(prompts, str(path))
    assert val == ["prompt 4", "something new"] and "prompt 4" not in train and len(train) == 29
    with pytest.raises(UserError, match="data.val_prompts_path=.*does not exist"):
        split_prompts(prompts, str(tmp_path / "missing.txt"))


def test_the_timestep_grid_covers_every_band_off_its_edges():
    assert timestep_grid(8).tolist() == [62.5, 187.5, 312.5, 437.5, 562.5, 687.5, 812.5, 937.5]


def val_run(tiny_path, cache_dir):
    spec = inspect_teacher(tiny_path)
    teacher = CpuPlacement().load(spec, OmegaConf.create({"guidance_scale": 5.0}), FP32, Topology())
    _, held_out = split_prompts(read_prompts(None), None)
    emb = encode_prompts(spec, held_out, "", 512, torch.float32, torch.device("cpu"), cache_dir)
    torch.manual_seed(0)
    student = build_student(spec, **STUDENT).train()
    val_set = build_val_set(emb, (16, 1, 8, 8), seed=0)
    return student, val_loss(student, lambda *a: teacher.targets(*a)[0], val_set, batch_size=8)


def test_val_loss_is_deterministic_across_reruns_and_reports_every_band(tiny_path, cache_dir):
    student, first = val_run(tiny_path, cache_dir)
    _, second = val_run(tiny_path, cache_dir)
    assert first == second  # bit for bit: fixed prompts, noise, grid; targets from a frozen teacher
    assert set(first) == {"val/loss", "val/loss_t<250", "val/loss_250-750", "val/loss_t>750"}
    assert all(v > 0 for v in first.values())
    assert student.training  # the check puts the student back in its mode


def test_loss_png_is_drawn_from_metrics_steps(tmp_path):
    rows = [{"step": s, "loss": 1.0 / s} for s in range(1, 21)]
    rows += [{"step": s, "val/loss": 2.0 / s, "val/loss_t<250": 1.0 / s, "val/loss_t>750": 3.0 / s} for s in (10, 20)]
    (tmp_path / "metrics_steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:10]))
    out = save_loss_plot(tmp_path, extra_rows=rows[10:])
    assert out == tmp_path / "loss.png" and Image.open(out).size == (700, 400)
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_with_a_latent_bank_validation_starts_from_each_prompts_first_latent(tiny_path, cache_dir):
    from wandistiller.data.latents import LatentBank

    spec = inspect_teacher(tiny_path)
    emb = encode_prompts(spec, ["a red fox", "a lighthouse"], "", 512, torch.float32, torch.device("cpu"), cache_dir)

    def bank(first: float) -> LatentBank:  # two latents per prompt; only the first may be used
        rows = torch.tensor([first, 100.0, first, 100.0]).view(4, 1, 1, 1, 1).expand(4, 16, 1, 8, 8)
        return LatentBank([rows.contiguous()], torch.tensor([0, 0, 1, 1]), chunk_size=4)

    zeros, ones = (build_val_set(emb, (16, 1, 8, 8), 0, timesteps=4, latent_bank=bank(v)) for v in (0.0, 1.0))
    s = (zeros.t / 1000).view(-1, 1, 1, 1, 1)
    # The same noise whatever x0 is: x_t = (1 - s) * x0 + s * noise with x0 the first latent, never the second.
    torch.testing.assert_close(zeros.x_t / s, (ones.x_t - (1 - s)) / s)
    assert (zeros.x_t / s).abs().max() < 10 and torch.equal(zeros.cond, emb.padded(torch.tensor([0] * 4 + [1] * 4)))
