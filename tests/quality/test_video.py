"""quality/video.py: `--teacher pocket_video`'s rows, table and targets (no training here; the whole comparison is
the lead's run)."""

from __future__ import annotations

import pytest

from wandistiller.pocket.clips import parse_video_prompt
from wandistiller.quality import video
from wandistiller.quality.__main__ import main, parse_args, settings_from, table, video_report
from wandistiller.quality.compare import prompt_set


def result(**over) -> dict:
    row = {
        "calls": 4,
        "frame_accuracy": 0.95,
        "motion_accuracy": 0.95,
        "motion_ratio": 1.0,
        "temporal_consistency": 0.9,
        "clip_fd": 10.0,
        "diversity_ratio": 1.0,
        "latent_mse": 0.1,
        "train_s": 60,
    }
    return row | over  # fmt: skip


def test_the_video_teachers_are_asked_by_name_and_judged_on_40_video_prompts():
    for teacher in video.VIDEO_TEACHERS:
        settings = settings_from(parse_args(["--teacher", teacher]))
        prompts = prompt_set(settings)
        assert len(prompts) == 40 and all(parse_video_prompt(p) for p in prompts)
        assert settings.batch_size == video.BATCH
        assert {parse_video_prompt(p).motion for p in prompts} == set(range(5))  # type: ignore[union-attr]
    assert len(prompt_set(settings_from(parse_args(["--teacher", "pocket_video", "--small"])))) == 6
    names = [row.name for row in video.ROWS]
    assert names[:2] == ["KD student at 20 steps", "KD student at 4 steps"] and len(names) == 8


def test_the_video_table_and_targets_say_where_the_motion_breaks(tmp_path):
    results = {
        "teacher": [result(calls=40)],
        "dmd + regression 0.1, 4 steps": [result(motion_ratio=0.6)],  # lost its motion
        "LoRA student rank 6, dmd, 4 steps": [result()],
    }
    lines = video.targets(results)
    assert lines[0].endswith(": met") and "motion ratio 0.60 (>= 0.85): MISSED" in lines[2]
    assert "motion ratio 1.00 (0.9-1.1)" in lines[1] and lines[1].endswith(": met")
    text = table(results, video.COLUMNS)
    assert "| motion_ratio |" in text and "| 95.0% |" in text
    report = video_report(results, settings_from(parse_args(["--teacher", "pocket_video"])), [], 60.0)
    assert "Targets (issue 40)" in report and "clip_fd" in report


def test_the_video_comparison_is_its_own_report(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--teacher", "pocket_video", "--fewstep", "--out", str(tmp_path / "q.md")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: --teacher pocket_video runs the video comparison")
    assert not (tmp_path / "q.md").exists()


def test_rows_choose_the_video_comparisons_rows_by_the_words_of_their_names(tmp_path, capsys):
    assert [row.name for row in video.chosen(["lora"])][0] == "LoRA student rank 6, dmd, 4 steps"
    assert len(video.chosen(["lora"])) == 3 and video.chosen(None) == video.ROWS
    for argv, words in (
        (["--teacher", "pocket_video", "--rows", "nothing"], "no row's name holds these words"),
        (["--rows", "LoRA"], "give --stacking or --teacher pocket_video"),
    ):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--out", str(tmp_path / "q.md")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err and err.count("\n") == 1


@pytest.mark.slow  # two small comparisons, each training and sampling a student (~1 min)
def test_the_kd_rows_share_one_student_and_a_second_sitting_trains_nothing(tmp_path):
    settings = settings_from(parse_args(["--teacher", "pocket_video", "--small"]))
    rows = video.chosen(["KD student"])  # at 20 and at 4 steps: one student, sampled twice
    first = video.compare_video(settings, tmp_path, rows, log=lambda _: None)
    runs = [p for p in (tmp_path / "seed0").iterdir()]
    assert [p.name for p in runs] == ["KD_student_at_20_steps"]
    written = (runs[0] / "metrics.json").stat().st_mtime_ns
    again = video.compare_video(settings, tmp_path, rows, log=lambda _: None)
    assert (runs[0] / "metrics.json").stat().st_mtime_ns == written  # finished: taken, not trained again
    assert [r["frame_accuracy"] for r in again["KD student at 4 steps"]] == [
        r["frame_accuracy"] for r in first["KD student at 4 steps"]
    ]
