"""wandistiller/data/sources/images.py: its check and its bank, the last captions held out, called directly."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import metrics_steps
from tests.data.test_images import CAPTIONS, TEACHER, data_cfg, write_folder
from wandistiller.core.distributed import Topology
from wandistiller.core.errors import UserError
from wandistiller.data.sources.images import Images, held_out_captions
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.train import run


def test_the_source_refuses_a_folder_it_cannot_use_before_anything_loads(tmp_path):
    with pytest.raises(UserError, match="set one of data.root .* or data.dataset"):
        Images.check(data_cfg())
    with pytest.raises(UserError, match=r"both data.root=.* and data.dataset=.* are set; keep one \(data.dataset=null"):
        Images.check(data_cfg(root=str(tmp_path), dataset=str(tmp_path)))  # e.g. an experiment's dataset, a root
    with pytest.raises(UserError, match=r"data.root=.*none"):
        Images.check(data_cfg(root=str(tmp_path / "none")))
    Images.check(data_cfg(root=str(write_folder(tmp_path / "images"))))


def context_of(data, spec=None, cache_dir=None):
    """The parts of a run's context (wandistiller.recipe.context.RunContext) the image source reads."""
    cpu, fp32 = torch.device("cpu"), SimpleNamespace(teacher_dtype=torch.float32)
    return SimpleNamespace(spec=spec, data_cfg=data, teacher_cfg=TEACHER, precision=fp32, device=cpu,
                           cache_dir=cache_dir, topo=Topology(), is_main=True)  # fmt: skip


def context(tiny_path, cache_dir, root, **data):
    data = data_cfg(**{"root": str(root), "val_prompts_path": None, "val_fraction": 0.1} | data)
    return context_of(data, inspect_teacher(tiny_path), cache_dir)


def test_no_captions_are_held_out_where_the_user_names_held_out_prompts_or_there_is_one_image(tmp_path):
    ctx = context_of(data_cfg(root=str(tmp_path), val_prompts_path=None, val_fraction=0.5))
    one = SimpleNamespace(prompts=["a fox"])  # caption i is image i's: one image
    assert held_out_captions(ctx, one, torch.device("cpu")) is None  # validates on its one caption
    ctx = context_of(data_cfg(root=str(tmp_path), val_prompts_path="val.txt", val_fraction=0.5))
    two = SimpleNamespace(prompts=["a fox", "a hen"])
    assert held_out_captions(ctx, two, torch.device("cpu")) is None


@pytest.mark.slow  # 2 s: the VAE encodes the folder and the text encoder loads twice
def test_the_last_images_captions_are_held_out_and_never_trained_on(tiny_path, cache_dir, tmp_path):
    root = write_folder(tmp_path / "images")
    made = Images.make(context(tiny_path, cache_dir, root), None, "prompts' embeddings", "held-out embeddings")
    assert made.embeddings.prompts == CAPTIONS[:2] and made.val_embeddings.prompts == CAPTIONS[-1:]
    assert len(made.embeddings.embeds) == 2  # a method drawing prompts (dmd, trajectory's ODE) draws these alone
    assert made.bank.prompt_idx.tolist() == [0, 1] and len(made.bank) == 2  # training draws the first two only
    given = context(tiny_path, cache_dir, root, val_prompts_path="val.txt")  # held-out prompts of the user's own
    whole = Images.make(given, None, "prompts' embeddings", "held-out embeddings")
    assert whole.val_embeddings == "held-out embeddings" and whole.bank.prompt_idx.tolist() == [0, 1, 2]
    assert whole.embeddings.prompts == CAPTIONS
    assert torch.equal(whole.bank.x0(torch.arange(2)), made.bank.x0(torch.arange(2)))


@pytest.mark.slow  # a whole run: the default lane keeps its 4 minutes
def test_a_student_trains_on_captioned_images(make_cfg, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i, caption in enumerate(["a red fox in snow", "a boat on a lake", "a city at night"]):
        Image.fromarray(rng.integers(0, 255, (72, 90, 3), dtype=np.uint8)).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(caption)
    summary = run(make_cfg("data=image_folder", f"data.root={images}", "trainer.max_steps=2", run_dir=tmp_path / "r"))
    assert summary["steps_run"] == 2
    # Clips of images, for a text-to-video teacher: said before anything is encoded, naming the teacher it needs
    # (the fix was once "set data.latent_frames=1" alone, which an image-to-video experiment's user did not mean).
    clips = ["data=image_folder", f"data.root={images}", "data.latent_frames=2", "trainer.max_steps=2"]
    with pytest.raises(UserError, match=r"^data.latent_frames=2 with images and a text-to-video teacher: .* give an "
                       r"image-to-video teacher .*, or data.latent_frames=1 to train on stills$"):  # fmt: skip
        run(make_cfg(*clips, run_dir=tmp_path / "clips"))
    assert not (tmp_path / "clips").exists()


@pytest.mark.parametrize("override", ["data=image_folder"])
def test_an_image_folder_run_without_a_folder_is_refused_in_one_line(make_cfg, tmp_path, override):
    from wandistiller.core.errors import UserError

    with pytest.raises(UserError, match="data.root"):
        run(make_cfg(override, "trainer.max_steps=2", run_dir=tmp_path / "r"))


def given_images(root, size=(72, 56), clear: int | None = None):
    """Three captioned images for an image-to-video teacher (each its clip's first frame); image `clear` with a
    transparent pixel."""
    root.mkdir()
    rng = np.random.default_rng(1)
    for i, caption in enumerate(CAPTIONS):
        image = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).convert("RGBA")
        if i == clear:
            image.putpixel((3, 3), (0, 0, 0, 0))
        image.save(root / f"img{i}.png")
        (root / f"img{i}.txt").write_text(caption)
    return root


def pairs(root, *extra: str) -> list[str]:
    small = ["data.latent_frames=2", "data.latent_height=4", "data.latent_width=4", "trainer.max_steps=2"]
    return ["teacher=tiny_i2v", "data=image_folder", f"data.root={root}", *small, *extra]


def test_an_image_to_video_teacher_trains_on_an_image_folder_each_image_given_as_its_first_frame(make_cfg, tmp_path):
    """`teacher=tiny_i2v data=image_folder data.root=...`: each image is its caption's given first frame (the
    teacher's VAE and CLIP encode it once); the held-out caption validates with its own image."""
    root = given_images(tmp_path / "images")
    summary = run(make_cfg(*pairs(root, "hooks.monitor.val_every=1"), run_dir=tmp_path / "r"))
    assert summary["steps_run"] == 2 and (tmp_path / "r" / "student").is_dir()
    rows = [r for r in metrics_steps(tmp_path / "r") if "val/loss" in r]
    assert rows and all(np.isfinite(r["val/loss"]) for r in rows)


def test_one_image_given_to_an_image_to_video_teacher_validates_on_itself(make_cfg, tmp_path):
    """One (image, caption) pair holds nothing out: the run validates on it, its caption with its own image, as a
    text run with one prompt does (the held-out set once took the prompts file's prompts beside the one image)."""
    root = given_images(tmp_path / "images")
    for extra in ("img1", "img2"):
        (root / f"{extra}.png").unlink()
        (root / f"{extra}.txt").unlink()
    summary = run(make_cfg(*pairs(root, "hooks.monitor.val_every=1"), run_dir=tmp_path / "r"))
    assert summary["steps_run"] == 2
    assert [r for r in metrics_steps(tmp_path / "r") if np.isfinite(r.get("val/loss", np.nan))]


def test_held_out_prompts_without_images_are_refused_and_stills_warned_of_for_an_image_to_video_teacher(
    make_cfg, tmp_path, caplog
):
    root = given_images(tmp_path / "images")
    (tmp_path / "v.txt").write_text("a held-out prompt\n")
    with pytest.raises(UserError) as e:
        run(make_cfg(*pairs(root, f"data.val_prompts_path={tmp_path / 'v.txt'}"), run_dir=tmp_path / "r"))
    said = "data.val_prompts_path gives prompts alone, but teacher=tiny_i2v is image-to-video"
    assert str(e.value).startswith(said) and "\n" not in str(e.value) and not (tmp_path / "r").exists()
    # One frame is the given image alone: said (a memory plan of one frame, bench plan's, still runs).
    caplog.set_level(logging.WARNING, logger="wandistiller")
    run(make_cfg(*pairs(root, "data.latent_frames=1", "trainer.max_steps=1"), run_dir=tmp_path / "still"))
    assert any(r.getMessage().startswith("data.latent_frames=1 is the given image alone") for r in caplog.records)


@pytest.mark.parametrize(
    "size,clear,said",
    [
        ((30, 56), None, "img0.png is 30x56, too small for the run's 32x32 frames"),
        ((72, 56), 1, "img1.png has transparent pixels (mode RGBA)"),
    ],
)
def test_an_image_that_cannot_be_a_first_frame_is_one_line_before_the_run_folder(make_cfg, tmp_path, size, clear, said):
    root = given_images(tmp_path / "images", size, clear)
    with pytest.raises(UserError) as e:
        run(make_cfg(*pairs(root), run_dir=tmp_path / "r"))
    assert str(e.value).startswith(f"data.root={str(root)!r}: {said}"), str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "r").exists()
    # A text-to-video teacher takes the same images as x0, scaled as they must be.
    run(make_cfg("data=image_folder", f"data.root={root}", "trainer.max_steps=1", run_dir=tmp_path / "t2v"))
