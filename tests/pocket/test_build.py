"""`wandistiller.pocket.build`'s folders: shipped ones load, train, guide samples (slow); rebuilds reproduce."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT
from wandistiller.pocket import (
    FRAME_CLASSIFIER_FILE,
    MOE_TEACHER_DIR,
    TEACHER_DIR,
    VIDEO_MOE_TEACHER_DIR,
    VIDEO_PROMPTS_FILE,
    VIDEO_TEACHER_DIR,
)
from wandistiller.pocket.clips import FRAMES, parse_video_prompt, read_motion
from wandistiller.pocket.digits import PROMPTS, parse_prompt
from wandistiller.train import run

# Issue 17's target for the teacher's guided samples (20 UniPC steps, CFG 3 as teacher/pocket.yaml, seed 0).
# The shipped build draws 39 and 40 of the 40 prompts right (pocket, pocket_moe; docs/QUALITY.md), so another
# torch build's float differences have 3 images of margin.
PROMPT_ACCURACY_FLOOR = 0.9
# The shipped video teachers (docs/QUALITY.md, "Video"): motion 100% and colour 100% of frames, the digit and colour
# on 94.0 and 93.2% of frames (93.9 and 93.3% here, seed 0, 2026-11-30); floors with a margin for another torch build.
VIDEO_MOTION_FLOOR, VIDEO_COLOUR_FLOOR, VIDEO_FRAME_FLOOR = 0.9, 0.95, 0.89


def pipeline(folder):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(folder, dtype=torch.float32, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def guided(pipe, prompts, steps, seed=0):
    """[N, 3, 32, 32] in [0, 1], as a user of WanPipeline makes them (the pocket's 16-token padding)."""
    out = pipe(prompt=prompts, negative_prompt="", height=32, width=32, num_frames=1, num_inference_steps=steps,
               guidance_scale=3.0, max_sequence_length=16, output_type="pt",
               generator=torch.Generator().manual_seed(seed)).frames  # fmt: skip
    return out[:, 0]


@pytest.mark.parametrize("folder", [TEACHER_DIR, MOE_TEACHER_DIR], ids=["pocket", "pocket_moe"])
def test_the_shipped_teachers_load_through_wan_pipeline(folder):
    pipe = pipeline(folder)
    assert (pipe.transformer_2 is not None) == (folder == MOE_TEACHER_DIR)
    if pipe.transformer_2 is not None:
        assert pipe.config.boundary_ratio == 0.875
    images = guided(pipe, PROMPTS[:2], steps=2)
    assert images.shape == (2, 3, 32, 32) and 0 <= images.min() and images.max() <= 1


def clips(pipe, prompts, steps, seed=0):
    """[N, FRAMES, 3, 32, 32] in [0, 1], as a user of WanPipeline makes them."""
    return pipe(prompt=prompts, negative_prompt="", height=32, width=32, num_frames=FRAMES, num_inference_steps=steps,
                guidance_scale=3.0, max_sequence_length=16, output_type="pt",
                generator=torch.Generator().manual_seed(seed)).frames  # fmt: skip


@pytest.mark.parametrize("folder", [VIDEO_TEACHER_DIR, VIDEO_MOE_TEACHER_DIR], ids=["pocket_video", "pocket_video_moe"])
def test_the_shipped_video_teachers_load_through_wan_pipeline_and_make_clips(folder):
    pipe = pipeline(folder)
    assert (pipe.transformer_2 is not None) == (folder == VIDEO_MOE_TEACHER_DIR)
    assert pipe.transformer.config.num_layers == 6  # grown from 4 (pocket/video.py): what the build makes
    assert pipe.vae.config.scale_factor_temporal == 2 and pipe.vae.config.temperal_downsample == [False, True]
    prompts = VIDEO_PROMPTS_FILE.read_text().split("\n")[:2]
    assert all(parse_video_prompt(p) for p in prompts)
    out = clips(pipe, prompts, steps=2)
    assert out.shape == (2, FRAMES, 3, 32, 32) and 0 <= out.min() and out.max() <= 1


@pytest.mark.slow
@pytest.mark.parametrize("folder", [VIDEO_TEACHER_DIR, VIDEO_MOE_TEACHER_DIR], ids=["pocket_video", "pocket_video_moe"])
def test_guided_clips_show_the_asked_digit_on_every_frame_moving_the_asked_way(folder):
    """The teacher's floors on the balanced first 40 prompts, seed 0, with a margin for another torch build's float
    differences (docs/QUALITY.md, "Video", has the 3-seed figures)."""
    from wandistiller.pocket.classifier import load_classifier

    prompts = VIDEO_PROMPTS_FILE.read_text().split("\n")[:40]
    out = clips(pipeline(folder), prompts, steps=20)
    wanted = torch.tensor([parse_video_prompt(p).labels for p in prompts])
    judged = load_classifier(FRAME_CLASSIFIER_FILE).predict(out.flatten(0, 1)).view(len(prompts), FRAMES, 2)
    assert (judged[..., 1] == wanted[:, None, 1]).float().mean() >= VIDEO_COLOUR_FLOOR
    assert (judged == wanted[:, None, :2]).all(-1).float().mean() >= VIDEO_FRAME_FLOOR
    assert (read_motion(out) == wanted[:, 2]).float().mean() >= VIDEO_MOTION_FLOOR


POCKET_EXPERIMENTS = sorted(p.stem for p in (ROOT / "wandistiller" / "conf" / "experiment").glob("pocket*.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("experiment", POCKET_EXPERIMENTS)
def test_every_pocket_experiment_trains(make_cfg, tmp_path, experiment):
    """Each pocket experiment as shipped, a few steps: their full lengths are minutes each (pocket_quarter's 4000
    steps alone ~8), so the docs' `+experiment=pocket...` commands are `long` in tests/test_readme.py."""
    short = ["trainer.max_steps=2"] + ([] if "i2v" in experiment else ["hooks.evaluate.limit=2"])  # I2V: no eval yet
    if "video" in experiment:  # the teacher samples its own clips of these first: a few, not 180
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("\n".join(VIDEO_PROMPTS_FILE.read_text().split("\n")[:6]) + "\n")
        short.append(f"data.prompts_path={prompts}")
    summary = run(make_cfg(f"+experiment={experiment}", *short, run_dir=tmp_path / experiment))
    assert summary["steps_run"] == 2


@pytest.mark.slow  # a whole CLI process: the default lane keeps its budget
def test_teacher_pocket_trains_a_student(make_cfg, tmp_path):
    summary = run(make_cfg("teacher=pocket", "data=pocket_digits", "trainer.max_steps=2", run_dir=tmp_path / "r"))
    assert summary["steps_run"] == 2 and summary["teacher_experts"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("folder", [TEACHER_DIR, MOE_TEACHER_DIR], ids=["pocket", "pocket_moe"])
def test_guided_samples_show_what_was_asked(folder):
    from wandistiller.evaluation.metrics import prompt_accuracy
    from wandistiller.pocket.classifier import load_classifier

    images = guided(pipeline(folder), PROMPTS, steps=20)
    wanted = torch.tensor([parse_prompt(p).labels for p in PROMPTS])
    scores = prompt_accuracy(load_classifier().predict(images), wanted)
    assert scores["colour_accuracy"] >= 0.95
    assert scores["prompt_accuracy"] >= PROMPT_ACCURACY_FLOOR


# A build stopped as its video part began a warm restart (its image part written, the video VAE and first phase
# saved as stages): python -m wandistiller.pocket.build as a user runs it, stopped where a kill would stop it.
STOPPED_BUILD = """
import sys
from wandistiller.pocket import build, stages

made = stages.Stages.__call__

def stopped(self, name, *rest):
    if self.folder.name == "video" and name == "phase1":
        raise SystemExit(9)
    return made(self, name, *rest)

stages.Stages.__call__ = stopped
build.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_the_build_is_reproducible_goes_on_from_where_it_stopped_and_writes_wan_folders(tmp_path):
    """Two builds write the same bytes, one of them stopped in its video part and run again: it goes on from its
    saved stages (the video teacher's build is ~5 h) and clears them. The folders' configs hold no path of the
    build's (the I2V teachers' VAE config held the --out they were built in)."""
    a, b = tmp_path / "a", tmp_path / "b"
    build = [sys.executable, "-m", "wandistiller.pocket.build", "--quick", "--out"]
    assert subprocess.run([*build, str(a)], capture_output=True, timeout=600).returncode == 0
    stopped = subprocess.run([sys.executable, "-c", STOPPED_BUILD, "--quick", "--out", str(b)], capture_output=True)
    assert stopped.returncode == 9 and (b / ".stages" / "video").is_dir()
    again = subprocess.run([*build, str(b)], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "stage video_vae: resumed" in again.stderr, again.stderr[-2000:]
    assert "stage phase1: resumed" not in again.stderr and not (b / ".stages").exists()
    digests = [sorted((f.relative_to(out), f.read_bytes()) for f in out.rglob("*.safetensors")) for out in (a, b)]
    # image and video: 7 model files + a judge each; image to video: 7 model files (the video judge is its judge)
    assert digests[0] == digests[1] and len(digests[0]) == 23
    configs = [sorted((f.relative_to(out), f.read_text()) for f in out.glob("pocket-*/*/*.json")) for out in (a, b)]
    assert configs[0] == configs[1] and not any(str(tmp_path) in text for _, text in configs[0])
    assert pipeline(tmp_path / "a" / "pocket-wan-t2v-moe").transformer_2 is not None
    video = pipeline(tmp_path / "a" / "pocket-wan-t2v-video-moe")
    assert video.vae.config.scale_factor_temporal == 2
    # The video teacher grows from the image teacher's 4 blocks to 6 (VIDEO_QUICK keeps the grow phase); the
    # image-to-video teacher starts from it, so it has 6 too.
    assert video.transformer.config.num_layers == video.transformer_2.config.num_layers == 6
    from diffusers import WanImageToVideoPipeline

    pair = WanImageToVideoPipeline.from_pretrained(tmp_path / "a" / "pocket-wan-i2v-moe")
    assert pair.transformer.config.in_channels == 34 and pair.config.boundary_ratio == 0.9
    assert pair.transformer.config.num_layers == 6


def test_the_i2v_teacher_is_refused_in_one_line_without_the_video_teacher_it_starts_from(tmp_path, capsys):
    from wandistiller.pocket.build import main

    with pytest.raises(SystemExit) as e:
        main(["--quick", "--only", "i2v", "--out", str(tmp_path / "empty")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "build it first (--only video)" in err
    assert not (tmp_path / "empty" / "pocket-wan-i2v").exists()


@pytest.mark.parametrize("where", ["a_file", "a_file/pocket"])
def test_an_out_that_cannot_be_a_folder_is_one_line_before_any_training(tmp_path, capsys, where):
    """Issue 41: `pocket.build --out FILE` (or a folder under a file) was a traceback from its first mkdir."""
    from wandistiller.pocket.build import main

    (tmp_path / "a_file").write_text("mine")
    with pytest.raises(SystemExit) as e:
        main(["--quick", "--out", str(tmp_path / where)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: --out {tmp_path / where}: ") and err.count("\n") == 1
    assert "choose another folder" in err and (tmp_path / "a_file").read_text() == "mine"


def test_a_second_build_into_the_same_folder_is_one_line_while_the_first_runs(tmp_path, capsys):
    """Two builds in one --out trained over each other's stages and replaced each other's folders, unseen."""
    import fcntl

    from wandistiller.pocket.build import main

    held = os.open(tmp_path / ".build.lock", os.O_RDWR | os.O_CREAT)  # as the first build holds it
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit) as e:
            main(["--quick", "--out", str(tmp_path)])
    finally:
        os.close(held)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "another build is writing there" in err
    assert [p.name for p in tmp_path.iterdir()] == [".build.lock"]


@pytest.mark.parametrize("in_its_place", ["folder", "link"])
def test_a_lock_file_that_cannot_be_opened_is_one_line_not_a_build_left_unguarded(tmp_path, capsys, in_its_place):
    """Any failure to open .build.lock was a warning, and the build went on with no lock at all."""
    from wandistiller.pocket.build import main

    lock = tmp_path / ".build.lock"
    if in_its_place == "folder":
        lock.mkdir()
    else:
        (tmp_path / "mine").write_text("mine")
        lock.symlink_to(tmp_path / "mine")
    with pytest.raises(SystemExit) as e:
        main(["--quick", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "its lock file .build.lock cannot be opened" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".build.lock", *(["mine"] if in_its_place == "link" else [])]
    )


def test_a_file_system_without_locks_builds_unguarded_and_says_so(tmp_path, monkeypatch, caplog):
    """A mount whose flock answers ENOLCK still builds (the lock guards, it does not forbid); another error is one
    line."""
    import errno
    import fcntl

    from wandistiller.core import atomic
    from wandistiller.pocket import build

    def no_locks(fd, op, error=errno.ENOLCK):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    monkeypatch.setattr(atomic, "_UNLOCKED_DEVICES", set())
    monkeypatch.setattr(build, "build_parts", lambda out, only, quick: {"image": 0.0})
    build.main(["--quick", "--out", str(tmp_path)])
    assert "not guarded against a second writer at the same time" in caplog.text
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: no_locks(fd, op, errno.EBADF))
    with pytest.raises(SystemExit) as e:
        build.main(["--quick", "--out", str(tmp_path)])
    assert e.value.code == 2


@pytest.mark.parametrize("where", ["run", "run/pocket"])
def test_an_out_in_a_run_folder_is_refused_before_any_training(tmp_path, capsys, where):
    # An audit's: `--out <a finished run>` wrote the pocket teachers, their data and a lock into it.
    from wandistiller.pocket.build import main

    (tmp_path / "run" / ".hydra").mkdir(parents=True)
    (tmp_path / "run" / ".hydra" / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(SystemExit) as e:
        main(["--quick", "--out", str(tmp_path / where)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"is or lies in the run folder {tmp_path / 'run'}" in err and err.count("\n") == 1
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".hydra"]
