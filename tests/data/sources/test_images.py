"""wandistiller/data/sources/images.py: its check and its bank, the last captions held out, called directly."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from tests.data.test_images import CAPTIONS, TEACHER, data_cfg, write_folder
from wandistiller.core.distributed import Topology
from wandistiller.core.errors import UserError
from wandistiller.data.latents import LatentBank
from wandistiller.data.sources.images import Images, held_out_captions
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.train import run


def test_the_source_refuses_a_folder_it_cannot_use_before_anything_loads(tmp_path):
    with pytest.raises(UserError, match="set one of data.root .* or data.dataset"):
        Images.check(data_cfg())
    with pytest.raises(UserError, match="set one of data.root .* or data.dataset"):
        Images.check(data_cfg(root=str(tmp_path), dataset=str(tmp_path)))
    with pytest.raises(UserError, match=r"data.root=.*none"):
        Images.check(data_cfg(root=str(tmp_path / "none")))
    Images.check(data_cfg(root=str(write_folder(tmp_path / "images"))))


def context_of(data, spec=None, cache_dir=None):
    """The parts of a run's context (wandistiller.core.context.RunContext) the image source reads."""
    cpu, fp32 = torch.device("cpu"), SimpleNamespace(teacher_dtype=torch.float32)
    return SimpleNamespace(spec=spec, data_cfg=data, teacher_cfg=TEACHER, precision=fp32, device=cpu,
                           cache_dir=cache_dir, topo=Topology(), is_main=True)  # fmt: skip


def context(tiny_path, cache_dir, root, **data):
    data = data_cfg(**{"root": str(root), "val_prompts_path": None, "val_fraction": 0.1} | data)
    return context_of(data, inspect_teacher(tiny_path), cache_dir)


def test_no_captions_are_held_out_where_the_user_names_held_out_prompts_or_there_is_one_image(tmp_path):
    ctx = context_of(data_cfg(root=str(tmp_path), val_prompts_path=None, val_fraction=0.5))
    embeddings = SimpleNamespace(prompts=["a fox"])  # held_out_captions reads the captions only on these paths
    one = LatentBank([torch.zeros(1, 16, 1, 8, 8)], torch.tensor([0]), chunk_size=1)
    assert held_out_captions(ctx, (embeddings, one), torch.device("cpu")) is None  # validates on its one caption
    ctx = context_of(data_cfg(root=str(tmp_path), val_prompts_path="val.txt", val_fraction=0.5))
    two = LatentBank([torch.zeros(2, 16, 1, 8, 8)], torch.tensor([0, 0]), chunk_size=2)
    assert held_out_captions(ctx, (embeddings, two), torch.device("cpu")) is None


@pytest.mark.slow  # 2 s: the VAE encodes the folder and the text encoder loads twice
def test_the_last_images_captions_are_held_out_and_never_trained_on(tiny_path, cache_dir, tmp_path):
    root = write_folder(tmp_path / "images")
    made = Images.make(context(tiny_path, cache_dir, root), None, "prompts' embeddings", "held-out embeddings")
    assert made.embeddings.prompts == CAPTIONS and made.val_embeddings.prompts == CAPTIONS[-1:]
    assert made.bank.prompt_idx.tolist() == [0, 1] and len(made.bank) == 2  # training draws the first two only
    given = context(tiny_path, cache_dir, root, val_prompts_path="val.txt")  # held-out prompts of the user's own
    whole = Images.make(given, None, "prompts' embeddings", "held-out embeddings")
    assert whole.val_embeddings == "held-out embeddings" and whole.bank.prompt_idx.tolist() == [0, 1, 2]
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


@pytest.mark.parametrize("override", ["data=image_folder"])
def test_an_image_folder_run_without_a_folder_is_refused_in_one_line(make_cfg, tmp_path, override):
    from wandistiller.core.errors import UserError

    with pytest.raises(UserError, match="data.root"):
        run(make_cfg(override, "trainer.max_steps=2", run_dir=tmp_path / "r"))
