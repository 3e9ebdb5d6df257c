"""A pocket build's saved stages: taken back only where everything before them, and the call itself, is the same,
exactly as made."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

from wandistiller.core.arch import TINY_TRANSFORMER
from wandistiller.pocket.stages import STAGES_DIR, Stages, clear_stages, loader

MADE: list[int] = []  # the seeds `trained` was called with: the stages made, not taken back


def trained(seed: int, steps: int = 100, data: torch.Tensor | None = None):
    """A stand-in for a training stage: a tiny Wan transformer whose weights follow from `seed` alone."""
    from diffusers import WanTransformer3DModel

    MADE.append(seed)
    torch.manual_seed(seed)
    return WanTransformer3DModel(**TINY_TRANSFORMER).eval().requires_grad_(False)


def trained_otherwise(seed: int, steps: int = 100, data: torch.Tensor | None = None):
    """`trained` edited: the same name and call, another body."""
    return trained(seed + 0)


trained_otherwise.__qualname__ = "trained"


def trained_after(previous, seed: int):
    """A stage that goes on from the last one's weights (a warm restart)."""
    return trained(seed)


@pytest.fixture(autouse=True)
def made():
    MADE.clear()
    return MADE


@pytest.fixture
def load():
    from diffusers import WanTransformer3DModel

    return loader(WanTransformer3DModel)


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_a_stage_saved_is_taken_back_as_made_and_what_follows_it_is_made(tmp_path, load, made):
    first = Stages(tmp_path, "video", origin="image teacher A")
    a = first("transformer", partial(trained, 1), load)
    b = first("phase1", partial(trained_after, a, 2), load)
    again = Stages(tmp_path, "video", origin="image teacher A")
    a2 = again("transformer", partial(trained, 1), load)
    b2 = again("phase1", partial(trained_after, a2, 2), load)  # the previous stage read back: the same call
    assert same(a, a2) and same(b, b2) and made == [1, 2] and again.resumed == ["transformer", "phase1"]
    assert not a2.training and not any(p.requires_grad for p in a2.parameters())  # as the training functions return


@pytest.mark.parametrize("changed", ["origin", "first settings", "data"])
def test_a_stage_after_any_change_before_it_is_made_again(tmp_path, load, made, changed):
    """Another teacher to start from, other settings of an earlier stage, other training data: the later stages
    saved under the old ones are not taken, though their own names and settings are the same."""

    def run(origin, steps, data):
        stages = Stages(tmp_path, "video", origin=origin)
        stages("transformer", partial(trained, 1, steps, data), load)
        made.clear()
        stages("phase1", partial(trained, 2), load)
        return list(made)

    assert run("A", 100, torch.zeros(3)) == [2]
    args = {"origin": ("B", 100, torch.zeros(3)), "first settings": ("A", 200, torch.zeros(3))}
    assert run(*args.get(changed, ("A", 100, torch.ones(3)))) == [2]
    assert run("A", 100, torch.zeros(3)) == []  # the first one's still there


def test_a_stage_is_keyed_by_its_call_its_defaults_included_not_by_settings_copied_beside_it(tmp_path, load, made):
    """Every argument the stage function receives keys it, a default as given: the same call spelt with its default
    is the same stage; another value of any argument, or a model it starts from with other weights, is another."""
    stages = lambda: Stages(tmp_path, "image")
    stages()("vae", partial(trained, 1), load)
    stages()("vae", partial(trained, 1, steps=100, data=None), load)
    assert made == [1]
    stages()("vae", partial(trained, 1, steps=101), load)
    assert made == [1, 1]
    a, b = trained(3), trained(4)
    made.clear()
    stages()("phase1", partial(trained_after, a, 5), load)
    stages()("phase1", partial(trained_after, b, 5), load)
    stages()("phase1", partial(trained_after, a, 5), load)
    assert made == [5, 5]
    made.clear()
    stages()("vae", partial(trained_otherwise, 1), load)  # its code changed: made again
    long = torch.zeros(5000)
    stages()("vae", partial(trained, 1, data=[(long, 1)]), load)
    long[2500] = 1  # deep in a list, in the middle of a long tensor (whose repr would elide it)
    stages()("vae", partial(trained, 1, data=[(long, 1)]), load)
    stages()("vae", partial(trained, 1, data=torch.tensor(0.5)), load)  # a 0-dim tensor keys too
    assert made == [1, 1, 1, 1]


def test_a_stage_left_half_saved_is_made_again_and_the_build_clears_its_stages(tmp_path, load):
    stages = Stages(tmp_path, "image")
    stages("vae", partial(trained, 1), load)
    saved = next((tmp_path / STAGES_DIR / "image").iterdir())
    (saved / "config.json").unlink()  # as a copy stopped midway would leave it
    again = Stages(tmp_path, "image")
    again("vae", partial(trained, 1), load)
    assert again.resumed == [] and (saved / "config.json").is_file()
    clear_stages(tmp_path, ["image"])
    assert not (tmp_path / STAGES_DIR).exists()


def test_a_damaged_stage_is_trained_again(tmp_path, load, made):
    Stages(tmp_path, "image")("vae", partial(trained, 1), load)
    weights = next((tmp_path / STAGES_DIR / "image").glob("*/diffusion_pytorch_model.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    again = Stages(tmp_path, "image")
    assert same(again("vae", partial(trained, 1), load), trained(1)) and again.resumed == []
    made.clear()
    Stages(tmp_path, "image")("vae", partial(trained, 1), load)
    assert made == []  # saved again


@pytest.mark.parametrize("other", ["instruction set", "kernel setting"])
def test_a_stage_made_on_other_float_kernels_is_trained_again(tmp_path, load, monkeypatch, other):
    """The same stage trains other bytes under another instruction set (docs/QUALITY.md): a shared --out resumed on
    another kind of CPU, or under a kernel setting, would have mixed two machines' weights into one build."""
    Stages(tmp_path, "image")("vae", partial(trained, 1), load)
    if other == "instruction set":
        now = torch.backends.cpu.get_cpu_capability()
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: f"not {now}")
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", os.environ.get("ONEDNN_MAX_CPU_ISA", "") + "_OTHER")
    again = Stages(tmp_path, "image")
    again("vae", partial(trained, 1), load)
    assert again.resumed == []


def test_a_stage_is_kept_where_the_file_system_cannot_flush_a_folder(tmp_path, load, monkeypatch, made):
    """SMB/CIFS and some FUSE mounts answer a folder's fsync with EINVAL: every stage was trained, then lost to a
    traceback, on every rerun. Its files are still flushed; another error still stops the build."""
    import errno
    import stat

    flush = os.fsync

    def no_folder_fsync(fd, error=errno.EINVAL):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(error, os.strerror(error))
        flush(fd)

    monkeypatch.setattr(os, "fsync", no_folder_fsync)
    Stages(tmp_path, "image")("vae", partial(trained, 1), load)
    Stages(tmp_path, "image")("vae", partial(trained, 1), load)
    assert made == [1]  # kept
    monkeypatch.setattr(os, "fsync", lambda fd: no_folder_fsync(fd, errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        Stages(tmp_path, "image")("transformer", partial(trained, 2), load)


def test_a_finished_part_clears_its_own_stages_only(tmp_path, load):
    """An --only image build into a folder holding a stopped video build's stages left hours of them in place."""
    for part in ("image", "video"):
        Stages(tmp_path, part)("vae", partial(trained, 1), load)
    clear_stages(tmp_path, ["image"])
    assert [p.name for p in (tmp_path / STAGES_DIR).iterdir()] == ["video"]
    clear_stages(tmp_path, ["video"])
    assert not (tmp_path / STAGES_DIR).exists()


def test_every_source_a_stage_follows_from_exists():
    """A misspelt entry would leave that source out of every key unseen."""
    from pathlib import Path

    from wandistiller.pocket import stages

    root = Path(stages.__file__).resolve().parents[1]
    assert all(list(root.glob(pattern)) for pattern in stages.SOURCES)
