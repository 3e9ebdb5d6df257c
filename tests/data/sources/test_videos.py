"""wandistiller/data/sources/videos.py (`data=video_folder`): a folder of captioned animated GIF / WebP clips trains
on the tiny teacher (its VAE: 8x space, 4x time), encoded once into cached [C, latent_frames, h, w] latents with
the last caption held out; what it cannot use is refused in one line through a run's preflight, once the teacher's
VAE is known and before the run folder is claimed; from the CLI exit 2 with no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import cli, metrics_steps
from tests.data.test_videos import CAPTIONS, write_videos
from wandistiller.core.errors import UserError
from wandistiller.data.latents import load_latent_bank
from wandistiller.data.sources.videos import Videos
from wandistiller.train import run


def videos(root: Path, *extra: str) -> list[str]:
    return ["data=video_folder", f"data.root={root}", "data.latent_frames=3", "trainer.max_steps=2", *extra]


def test_a_video_folder_trains_on_its_clips_encoded_once(make_cfg, tmp_path, cache_dir):
    root = write_videos(tmp_path / "clips")
    folder = tmp_path / "run"
    run(make_cfg(*videos(root, "hooks.monitor.val_every=1", "trainer.batch_size=2"), run_dir=folder))
    assert all(np.isfinite(r["loss"]) for r in metrics_steps(folder) if "loss" in r)
    banks = [load_latent_bank(p) for p in (cache_dir / "video_latents").iterdir()]
    bank = next(b for b in banks if b is not None and b.latent_shape == (16, 3, 8, 8))
    x0 = bank.x0(torch.arange(len(bank)))
    assert len(bank) == 3 and torch.isfinite(x0).all() and not torch.equal(x0[:, :, 1], x0[:, :, 2])
    saved = OmegaConf.load(folder / ".hydra" / "config.yaml").data  # what an evaluation of the run holds out
    assert Videos.held_out_prompts(saved, lambda key: None) == CAPTIONS[-1:]


def refused_run(make_cfg, tmp_path, root, *extra) -> str:
    with pytest.raises(UserError) as e:
        run(make_cfg(*videos(root, *extra), run_dir=tmp_path / "r"))
    assert "\n" not in str(e.value) and not (tmp_path / "r").exists()
    return str(e.value)


def test_too_few_frames_for_the_teachers_vae_is_one_line_before_the_run_folder(make_cfg, tmp_path):
    root = write_videos(tmp_path / "clips", frames=5)  # 3 latent frames take 9 (the tiny VAE: 4x time)
    error = refused_run(make_cfg, tmp_path, root)
    assert error.startswith(f"data.root='{root}': a.gif has 5 frame(s), fewer than the 9 a clip of 9 frames"), error
    assert error.endswith("lower data.latent_frames or remove it"), error
    assert "fewer than the 17" in refused_run(make_cfg, tmp_path, root, "data.frame_step=2")  # every 2nd frame
    assert "set data.root" in refused_run(make_cfg, tmp_path, "null")


def test_data_fps_out_of_range_or_beside_a_frame_step_is_one_line_before_the_run_folder(make_cfg, tmp_path):
    root = write_videos(tmp_path / "clips")
    assert "data.fps=0" in refused_run(make_cfg, tmp_path, root, "data.fps=0")
    error = refused_run(make_cfg, tmp_path, root, "data.fps=16", "data.frame_step=2")
    assert error.startswith("data.fps=16 and data.frame_step=2 both pick a clip's frames; set one of them"), error
    error = refused_run(make_cfg, tmp_path, root, "data.fps=24")  # the 16 fps GIFs: their frames would repeat
    assert "a.gif is stored at 16.7 fps, fewer than data.fps=24" in error, error


def test_a_run_saved_before_data_fps_resumes_as_it_trained(make_cfg, tmp_path):
    """Its saved config has no data.fps: the whole config of now (data.fps=None) is the same run, not a change."""
    root, folder = write_videos(tmp_path / "clips"), tmp_path / "run"
    run(make_cfg(*videos(root, "trainer.checkpoint_every=2"), run_dir=folder))
    saved = OmegaConf.load(folder / ".hydra" / "config.yaml")
    del saved.data["fps"]
    OmegaConf.save(saved, folder / ".hydra" / "config.yaml")
    run(make_cfg(*videos(root, "trainer.max_steps=4", "trainer.resume=auto"), run_dir=folder))
    assert max(r["step"] for r in metrics_steps(folder) if "loss" in r) == 4


def test_a_folder_changed_since_the_run_began_is_refused_by_its_resume_and_its_eval(make_cfg, tmp_path):
    """A clip added to the folder: the last data.val_fraction are others, so the eval judged a clip it trained on
    (and replaced eval.json with it), and a resume trained on one it held out. Both refused; restored, both go on."""
    from tests.data.test_videos import clip, save
    from wandistiller.evaluation.evaluate import EvalSettings, evaluate
    from wandistiller.state.trust import Trust

    root, folder = write_videos(tmp_path / "clips"), tmp_path / "run"
    run(make_cfg(*videos(root, "trainer.checkpoint_every=2"), run_dir=folder))  # no end-of-run eval
    assert json.loads((folder / ".hydra" / "data.json").read_text())["items"] == 3
    save(clip(9), root / "d.gif", "a red square moving right, again")
    resume = videos(root, "trainer.max_steps=4", "trainer.resume=auto")
    with pytest.raises(UserError) as e:
        run(make_cfg(*resume, run_dir=folder))
    assert str(e.value).startswith(f"trainer.resume: data.root='{root}' changed since the run first read it (3 videos "
                                   "then, 4 now, or their names, sizes or captions differ)"), e.value  # fmt: skip
    settings = EvalSettings(steps=1, limit=1, trust=Trust(data=True))
    with pytest.raises(UserError, match="its held-out items would be others, some of them trained on; give --prompts"):
        evaluate(folder, settings)
    assert not (folder / "eval.json").exists()
    (root / "d.gif").unlink()
    (root / "d.txt").unlink()
    evaluate(folder, settings)
    run(make_cfg(*resume, run_dir=folder))
    assert max(r["step"] for r in metrics_steps(folder) if "loss" in r) == 4


def test_the_data_record_is_made_at_a_folders_first_launch_and_is_no_bar_where_nothing_of_it_was_held_out(
    make_cfg, tmp_path
):
    """A checkpoint named by path into a new folder records it too (its eval judged a changed folder unsaid); a run
    that held out prompts of the user's own (data.val_prompts_path) resumes on a folder that gained a clip."""
    from tests.data.test_videos import clip, save

    root, first, second = write_videos(tmp_path / "clips"), tmp_path / "first", tmp_path / "second"
    (tmp_path / "val.txt").write_text("a red square moving up\n")
    own = ("trainer.checkpoint_every=2", f"data.val_prompts_path={tmp_path / 'val.txt'}")
    run(make_cfg(*videos(root, *own), run_dir=first))
    step = first / "checkpoints" / "step_00000002"
    run(make_cfg(*videos(root, *own, "trainer.max_steps=3", f"trainer.resume={step}"), run_dir=second))
    assert json.loads((second / ".hydra" / "data.json").read_text())["items"] == 3
    save(clip(9), root / "d.gif", "a red square moving right, again")
    run(make_cfg(*videos(root, *own, "trainer.max_steps=4", "trainer.resume=auto"), run_dir=first))  # none held out


def test_an_mp4_without_pyav_names_the_package(make_cfg, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # as where it is not installed (the dev install brings it)
    root = write_videos(tmp_path / "clips")
    (root / "d.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    (root / "d.txt").write_text("a clip")
    error = refused_run(make_cfg, tmp_path, root)
    assert "d.mp4 is a .mp4 video, which needs PyAV to decode; pip install av" in error, error


@pytest.mark.slow  # ~30 s here: a fresh interpreter imports torch and composes
def test_from_the_cli_a_bad_video_is_exit_2_and_one_line(tmp_path, cache_dir, tiny_path):
    root = write_videos(tmp_path / "clips", frames=5)
    out = tmp_path / "r"
    args = cli(f"hydra.run.dir={out}", f"paths.cache_dir={cache_dir}", "logger=none", *videos(root))
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: data.root=") and "fewer than the 9" in lines[-1], done.stderr
    assert "Traceback" not in done.stderr and not out.exists()


def test_an_image_to_video_teacher_trains_on_a_video_folder_each_clip_given_its_own_first_frame(
    make_cfg, tmp_path, cache_dir
):
    """Wan's own I2V training pairs: clip i is x0 and its first frame, fitted as the clip is, the given image (the
    teacher's VAE encodes it with black frames behind, as WanImageToVideoPipeline does)."""
    from tests.conftest import encode_condition
    from wandistiller.data.conditions import fitted, image_bank
    from wandistiller.data.videos import ClipShape, folder_videos, read_clip
    from wandistiller.teacher.spec import inspect_teacher
    from wandistiller.teacher.vae import load_vae

    root = write_videos(tmp_path / "clips")
    cfg = make_cfg(*videos(root, "teacher=tiny_i2v_moe", "data.latent_frames=2", "hooks.monitor.val_every=1"))
    summary = run(cfg)
    assert summary["steps_run"] == 2
    assert all(np.isfinite(r["val/loss"]) for r in metrics_steps(tmp_path / "run") if "val/loss" in r)
    spec, cpu = inspect_teacher(Path(cfg.teacher.path)), torch.device("cpu")
    source, shape = folder_videos(str(root)), ClipShape(5, 1, 64, 64)
    first = [read_clip(source, i, shape, cfg.data)[0] for i in range(3)]
    key = "data.root"  # the run's own bank, read from its cache: no model loads
    bank = image_bank(spec, first.__getitem__, str, 3, source.fingerprint, cfg.data, cache_dir, cpu, key, False)
    expected = encode_condition(spec, load_vae(spec, cpu), [fitted(f, 64, 64, "", "") for f in first], 2, 64, 64)
    torch.testing.assert_close(bank.select(torch.arange(3)).latents, expected.latents, rtol=0, atol=1e-6)
