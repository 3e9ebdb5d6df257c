"""wandistiller/recipe/samples.py: the teacher-vs-student grid's layout read back pixel by pixel from tiny images, a
run's grid drawing its student beside the teacher column (none without samples), and (slow) a sample drawn by the tiny
teacher's own pipeline."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from tests.conftest import FP32
from wandistiller.core.distributed import Topology
from wandistiller.data.prompts import PromptEmbeddings
from wandistiller.evaluation.grids import CELL
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.recipe.samples import SampleGrid, sample_grids, teacher_images
from wandistiller.teacher.spec import inspect_teacher

HEADER, CAPTION = 24, 36  # the column titles' band above the rows and each row's caption band


@pytest.mark.slow  # the tiny teacher's VAE and pipeline, three times
def test_the_teacher_draws_one_first_frame_per_prompt_asked_for_the_same_for_a_seed(tiny_path):
    spec = inspect_teacher(tiny_path)
    guidance = OmegaConf.create({"guidance_scale": 5.0, "guidance_scale_2": None})
    teacher = CpuPlacement().load(spec, guidance, FP32, Topology())
    g = torch.Generator().manual_seed(0)
    prompts = PromptEmbeddings(["a", "b", "c"], [torch.randn(n, 32, generator=g) for n in (3, 5, 7)],
                               torch.zeros(0, 32), 512)  # fmt: skip
    data = OmegaConf.create({"latent_frames": 1, "latent_height": 8, "latent_width": 8})
    drawn = teacher_images(teacher, prompts, data, num_prompts=2, steps=2, seed=0)
    assert drawn.shape == (2, 64, 64, 3) and drawn.min() >= 0 and drawn.max() <= 1  # 8 latents x the VAE's 8
    assert np.array_equal(teacher_images(teacher, prompts, data, num_prompts=2, steps=2, seed=0), drawn)
    assert not np.array_equal(teacher_images(teacher, prompts, data, num_prompts=2, steps=2, seed=1), drawn)


def test_a_runs_grid_draws_the_student_beside_the_teacher_column_and_there_is_none_without_samples(tiny_path, tmp_path):
    from types import SimpleNamespace

    from wandistiller.student.model import build_student

    assert sample_grids(SimpleNamespace(), None, None, 0, 1) is None  # no prompts: no teacher needed, none drawn
    spec = inspect_teacher(tiny_path)
    g = torch.Generator().manual_seed(0)
    prompts = PromptEmbeddings(["a", "b"], [torch.randn(n, 32, generator=g) for n in (3, 5)], torch.zeros(0, 32), 512)
    data = OmegaConf.create({"latent_frames": 1, "latent_height": 8, "latent_width": 8})
    ctx = SimpleNamespace(spec=spec, data_cfg=data, seed=0, run_dir=tmp_path, student_steps=None)
    student = build_student(spec, builder="tiny", init="random").train()
    column = np.zeros((1, 64, 64, 3), dtype=np.float32)
    path = SampleGrid(ctx, column, prompts, 1, 1)(student, tmp_path / "samples" / "grid.png")
    assert path == tmp_path / "samples" / "grid.png" and student.training  # back to training once drawn
    grid = np.asarray(Image.open(path).convert("RGB"))
    assert grid.shape == (HEADER + CELL + CAPTION, 2 * CELL, 3)  # one prompt: the teacher's, then the student's
    assert grid[HEADER : HEADER + CELL, :CELL].max() == 0  # the teacher column as given


def test_a_few_step_students_grid_draws_it_at_its_k_on_the_sigmas_it_is_trained_at(tiny_path, tmp_path):
    """The grid shows a few-step student as it will be sampled: K calls on `method.schedule`'s sigmas, whatever
    `hooks.samples.steps` (the teacher column's) says."""
    from types import SimpleNamespace

    from wandistiller.student.model import build_student
    from wandistiller.teacher.fewstep import Schedule

    spec = inspect_teacher(tiny_path)
    prompts = PromptEmbeddings(["a"], [torch.randn(3, 32, generator=torch.Generator().manual_seed(0))],
                               torch.zeros(0, 32), 512)  # fmt: skip
    data = OmegaConf.create({"latent_frames": 1, "latent_height": 8, "latent_width": 8})
    schedule = Schedule("list", None, (1.0, 0.4))
    ctx = SimpleNamespace(spec=spec, data_cfg=data, seed=0, run_dir=tmp_path, student_steps=2)
    ctx.student_schedule = schedule
    student = build_student(spec, builder="tiny", init="random").train()
    timesteps: list[float] = []
    student.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: timesteps.append(float(kwargs["timestep"].flatten()[0])), with_kwargs=True
    )
    SampleGrid(ctx, np.zeros((1, 64, 64, 3), dtype=np.float32), prompts, 1, 5)(student, tmp_path / "grid.png")
    assert timesteps == pytest.approx([1000.0, 400.0])


def clip_grid(tiny_path, tmp_path):
    """A clip run's grid (data.latent_frames=2: 5 frames) of a tiny random student, drawn once at step 2."""
    from types import SimpleNamespace

    from wandistiller.student.model import build_student

    spec = inspect_teacher(tiny_path)
    g = torch.Generator().manual_seed(0)
    prompts = PromptEmbeddings(
        ["a fox", "b"], [torch.randn(n, 32, generator=g) for n in (3, 5)], torch.zeros(0, 32), 512
    )
    data = OmegaConf.create({"latent_frames": 2, "latent_height": 8, "latent_width": 8})  # 5 frames (time 4x)
    ctx = SimpleNamespace(spec=spec, data_cfg=data, seed=0, run_dir=tmp_path, student_steps=None)
    student = build_student(spec, builder="tiny", init="random").train()
    column = np.zeros((1, 5, 64, 64, 3), dtype=np.float32)  # the teacher's clip: black
    grids = SampleGrid(ctx, column, prompts, 1, 1)
    path = grids(student, tmp_path / "samples" / "step_00000002.png")
    assert path == tmp_path / "samples" / "step_00000002.png" and path.with_suffix(".gif").is_file()
    return grids, student


def test_a_clip_runs_grid_is_a_still_strip_and_a_gif_beside_it(tiny_path, tmp_path):
    clip_grid(tiny_path, tmp_path)
    path = tmp_path / "samples" / "step_00000002.png"
    with Image.open(path.with_suffix(".gif")) as gif:
        assert gif.n_frames == 5
    strip = np.asarray(Image.open(path).convert("RGB"))
    assert strip.shape[1] > 2 * strip.shape[0]  # the frames in a row, teacher over student


@pytest.mark.slow  # ~10 s: an offline wandb run started and finished
def test_a_clip_runs_samples_reach_wandb_as_video_and_tensorboard_as_the_strip_without_moviepy(
    tiny_path, tmp_path, caplog
):
    import logging
    from types import SimpleNamespace

    from wandistiller.recipe.hooks.samples import SampleGrids
    from wandistiller.tracking.loggers.tensorboard import TensorboardLogger
    from wandistiller.tracking.loggers.wandb import WandbTracker

    grids, student = clip_grid(tiny_path, tmp_path)
    hook = SampleGrids(every=2, prompts=1, steps=1)
    hook.samples = grids
    wandb, board = WandbTracker(project="p", mode="offline"), TensorboardLogger()
    run = SimpleNamespace(student=student, run_dir=tmp_path, tracker=None)
    for logger in (wandb, board):
        logger.start(tmp_path, {}, None)
        run.tracker = logger
        with caplog.at_level(logging.INFO):
            hook(run, 2)
            hook(run, 4)
        logger.finish({})
    videos = list((tmp_path / "wandb").rglob("media/videos/samples_clips_*.gif"))
    assert len(videos) == 2  # wandb holds each as a video
    assert caplog.text.count("add_video needs moviepy") == 1  # without moviepy: the strip, said once


@pytest.mark.parametrize("teacher", ["tiny_i2v", "tiny_ti2v"])
def test_an_image_to_video_runs_grid_starts_each_clip_from_its_prompts_own_image(make_cfg, tmp_path, teacher):
    """The grid of an I2V run (Wan 2.1's layout, TI2V's first-frame replacement) is drawn through the model's own
    WanImageToVideoPipeline from each training prompt's image; before, it was skipped with a warning."""
    from PIL import Image

    from tests.data.sources.test_images import given_images
    from wandistiller.train import run

    root, folder = given_images(tmp_path / "images", size=(72, 64)), tmp_path / "run"
    small = ["data.latent_frames=2", "data.latent_height=4", "data.latent_width=4", "trainer.max_steps=1"]
    grid = ["hooks=[samples]", "hooks.samples.prompts=2", "hooks.samples.steps=2"]
    run(make_cfg(f"teacher={teacher}", "data=image_folder", f"data.root={root}", *small, *grid, run_dir=folder))
    strip = np.asarray(Image.open(folder / "samples.png"))
    gif = Image.open(folder / "samples.gif")
    assert strip.std() > 0 and gif.n_frames == 5  # every frame of the clip: 2 latent frames, 5 pixel frames
