"""evaluation/clips.py: the clip figures on rendered clips (real pixels, a real judge network), and a clip run
against the wrong kind of pocket teacher refused in one line by eval and generate."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from wandistiller import eval as eval_cli
from wandistiller import generate as generate_cli
from wandistiller.core.arch import POCKET_VAE
from wandistiller.evaluation.clips import (
    MIN_FD_CLIPS,
    clip_features,
    frame_features,
    frame_motion,
    motion_ratio,
    pocket_clip_scores,
)
from wandistiller.pocket import TEACHER_DIR, VIDEO_TEACHER_DIR
from wandistiller.pocket.classifier import DigitJudge
from wandistiller.pocket.clips import rendered_clip_split
from wandistiller.teacher.vae import pocket_frames, pocket_frames_problem


@pytest.fixture(scope="module")
def rendered():
    clips, _, prompts = rendered_clip_split("heldout", seed=3)
    return clips[:200], prompts[:200]  # 80 judged, the rest the Fréchet distance's reference


def test_moving_clips_read_their_motion_and_still_ones_have_none(rendered):
    clips, prompts = rendered[0][:80], rendered[1][:80]
    judge = DigitJudge().eval()  # an untrained judge: the motion figures read pixels, not the judge
    moving = pocket_clip_scores(clips, prompts, judge)
    assert moving["motion_accuracy"] == 1.0 and moving["speed"] > 0.4 and moving["samples"] == 80
    still = clips[:, :1].expand_as(clips).contiguous()  # every clip frozen at its first frame
    frozen = pocket_clip_scores(still, prompts, judge)
    assert frozen["speed"] < 1e-4 and frozen["temporal_consistency"] == 1.0  # one frame judged 17 times
    assert frozen["motion_accuracy"] == pytest.approx(sum("still" in p for p in prompts) / 80)
    scores = {f"teacher_{k}": v for k, v in moving.items()} | {f"student_{k}": v for k, v in frozen.items()}
    assert motion_ratio(scores)["motion_ratio"] < 1e-3
    assert motion_ratio({"teacher_frame_motion": 0.2, "student_frame_motion": 0.1}) == {"motion_ratio": 0.5}
    assert frame_motion(still).max() == 0 and frame_motion(clips).min() >= 0


@pytest.mark.slow  # ~10 s on a busy 2-core CPU: 4,000 frames through the judge
def test_the_clip_frechet_distance_is_withheld_below_its_clip_count_and_sees_lost_motion(rendered):
    (clips, reference_clips), prompts = rendered[0].split([80, 120]), rendered[1][:80]
    torch.manual_seed(0)
    judge = DigitJudge().eval()
    reference = clip_features(frame_features(judge, reference_clips))
    assert "clip_fd" not in pocket_clip_scores(clips[: MIN_FD_CLIPS - 1], prompts[: MIN_FD_CLIPS - 1], judge, reference)
    moving = pocket_clip_scores(clips, prompts, judge, reference)["clip_fd"]
    still = pocket_clip_scores(clips[:, :1].expand_as(clips).contiguous(), prompts, judge, reference)["clip_fd"]
    assert 0 <= moving < still


def test_a_pocket_teachers_frames_are_read_off_its_vae(tmp_path):
    assert pocket_frames(TEACHER_DIR) == "image" and pocket_frames(tmp_path) is None
    if VIDEO_TEACHER_DIR.is_dir():
        assert pocket_frames(VIDEO_TEACHER_DIR) == "clips"
    video = tmp_path / "video"
    (video / "vae").mkdir(parents=True)
    (video / "vae" / "config.json").write_text(json.dumps(POCKET_VAE | {"scale_factor_temporal": 2}))
    assert pocket_frames(video) == "clips"  # the layers' 2x, declared
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps(POCKET_VAE | {"temperal_downsample": [True, True]}))
    assert pocket_frames(tmp_path) == "clips"  # 4x made, 4x declared (the default)
    assert "pocket image teacher" in str(pocket_frames_problem(TEACHER_DIR, 5))
    assert pocket_frames_problem(TEACHER_DIR, 1) is None
    assert (
        "makes clips (its VAE is the pocket video and image-to-video teachers" in str(pocket_frames_problem(video, 1))
        and pocket_frames_problem(video, 5) is None
    )


@pytest.mark.parametrize("teacher", ["image", "video"])
def test_a_run_against_the_other_kind_of_pocket_teacher_is_one_line_and_nothing_written(
    finished, tmp_path, capsys, teacher
):
    folder, path, frames = tmp_path / "run", TEACHER_DIR, 5  # a clip run against the image teacher
    if teacher == "video":  # a one-frame run against the video teacher
        path, frames = VIDEO_TEACHER_DIR, 1
        if not path.is_dir():
            pytest.skip("the pocket video teacher is not built here (python -m wandistiller.pocket.build --only video)")
    shutil.copytree(finished, folder)
    config = folder / ".hydra" / "config.yaml"
    cfg = OmegaConf.load(config)
    cfg.data.latent_frames = frames
    OmegaConf.save(cfg, config)
    before = sorted(p.name for p in folder.iterdir())
    for cli, extra in ((eval_cli, []), (generate_cli, ["--prompt", "a red 3 moving left"])):
        with pytest.raises(SystemExit) as e:
            cli.main([str(folder), "--teacher-path", str(path), *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        said = "pocket image teacher" if teacher == "image" else "makes clips (its VAE is the pocket video and image"
        assert said in err and "--teacher-path" in err and "Traceback" not in err
    assert sorted(p.name for p in folder.iterdir()) == before


@pytest.mark.slow  # a 1-step run and its evaluation on clips (~20 s)
def test_eval_of_a_clip_run_judges_every_frame_and_writes_the_strip_and_the_gif(make_cfg, tmp_path, capsys):
    from PIL import Image

    from wandistiller.train import run

    folder = tmp_path / "run"
    run(make_cfg("trainer.max_steps=1", "data.latent_frames=2", run_dir=folder))  # the tiny teacher: 5 frames
    eval_cli.main([str(folder), "--steps", "2", "--limit", "2", "--per-prompt", "2"])
    out = capsys.readouterr().out
    stem = "eval_steps2_limit2_perprompt2"
    assert f"wrote {folder / (stem + '.json')} and {stem}.png and {stem}.gif" in out
    result = json.loads((folder / f"{stem}.json").read_text())
    mean = result["mean"]
    # not pocket prompts: the frame-difference motion and its ratio; no judge, so no accuracy and no clip_fd
    assert mean["teacher_frame_motion"] > 0 and mean["motion_ratio"] > 0 and "student_frame_accuracy" not in mean
    assert "clip_fd" not in result.get("withheld", {}) and result["files"][2] == f"{stem}.gif"
    with Image.open(folder / f"{stem}.gif") as gif:
        assert gif.n_frames == 5
