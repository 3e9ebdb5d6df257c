"""quality/i2v.py: `--teacher pocket_i2v`'s rows, given frames, PSNR, table and targets; one small comparison end to
end (slow) on the shipped pocket I2V teacher."""

from __future__ import annotations

import math

import pytest
import torch

from wandistiller.pocket.clips import parse_video_prompt, read_motion
from wandistiller.quality import i2v
from wandistiller.quality.__main__ import i2v_report, main, parse_args, settings_from, table
from wandistiller.quality.compare import prompt_set


def result(**over) -> dict:
    row = {
        "calls": 4,
        "identity_held": 0.95,
        "motion_accuracy": 0.95,
        "motion_ratio": 1.0,
        "first_frame_psnr": 30.0,
        "clip_fd": 10.0,
        "train_s": 60,
    }
    return row | over  # fmt: skip


def test_the_i2v_teachers_are_judged_on_40_video_prompts_with_clip_batches_and_the_experiments_steps():
    for teacher in i2v.I2V_TEACHERS:
        settings = settings_from(parse_args(["--teacher", teacher]))
        prompts = prompt_set(settings)
        assert len(prompts) == 40 and all(parse_video_prompt(p) for p in prompts)
        assert settings.batch_size == 4 and settings.max_steps == i2v.STEPS
    assert settings_from(parse_args(["--teacher", "pocket_i2v", "--steps", "50"])).max_steps == 50


def test_the_given_frames_are_held_out_digits_placed_as_each_prompt_asks_and_differ_per_noise():
    prompts = ["a red 3 moving left", "a blue 7 moving right", "a green 0 standing still"]
    first, second = i2v.given_frames(prompts, seed=0, per_prompt=2)
    assert first.shape == (3, 3, 32, 32) and not torch.equal(first, second)
    assert torch.equal(first, i2v.given_frames(prompts, seed=0, per_prompt=1)[0])  # the same for every row
    # A left-mover starts at the right edge, a right-mover at the left one: the frame says where the clip goes.
    mass = first.sum(1)  # [3, 32, 32]
    columns = (mass.sum(1) * torch.arange(32.0)).sum(-1) / mass.sum((1, 2))
    assert columns[0] > 16 > columns[1]
    clips = i2v.clips_for(prompts, "test", 0)
    assert read_motion(clips).tolist() == [0, 1, 4]  # left, right, still (MOTIONS' order)
    with pytest.raises(ValueError, match="not a pocket video prompt"):
        i2v.clips_for(["a cat"], "test", 0)


def test_first_frame_psnr_is_of_each_clips_8_bit_frame_0_and_infinite_copies_are_capped():
    from wandistiller.evaluation.clips import first_frame_psnr

    given = torch.rand(2, 3, 8, 8)
    clips = torch.stack([given, torch.rand(2, 3, 8, 8)], dim=1)  # [2 clips, 2 frames]: frame 0 is the given one
    assert first_frame_psnr(clips, given) == pytest.approx([100.0, 100.0])  # mse floored at 1e-10
    off = (given + 0.1).clamp(0, 1)
    mse = ((((off * 255).round() - (given * 255).round()) / 255) ** 2).flatten(1).mean(1)
    assert first_frame_psnr(off[:, None], given) == pytest.approx((-10 * torch.log10(mse)).tolist(), rel=1e-5)


def test_the_i2v_targets_hold_the_lora_student_to_95_percent_and_the_pair_to_90():
    results = {"teacher": [result(calls=40)], i2v.LORA_ROW: [result(identity_held=0.88)]}  # 93% of the teacher's
    single, pair = i2v.targets(results, pair=False), i2v.targets(results, pair=True)
    assert single[0].endswith(": met") and "first-frame PSNR 30.0 dB" in single[0]
    assert single[1].endswith(": MISSED") and "93% of the teacher's identity held" in single[1]
    assert pair[1].startswith("- the A14B-layout pair") and pair[1].endswith(": met")
    assert i2v.targets({"teacher": [result(motion_accuracy=0.5)]}, False)[0].endswith(": MISSED")
    text = table(results, i2v.COLUMNS)
    assert "| identity_held |" in text and "| 88.0% |" in text and "| 30.0 |" in text
    report = i2v_report(results, settings_from(parse_args(["--teacher", "pocket_i2v_moe"])), [], 60.0)
    assert "Targets (issue 42)" in report and "Wan 2.2 I2V A14B layout" in report


def test_a_table_of_several_seeds_leaves_out_withheld_figures():
    """A figure withheld on a seed (nan: the teacher's training time, a clip FD below enough clips) is left out of
    that row's mean and spread, as seed_mean leaves it out of the targets; at two seeds it broke the table."""
    teacher = result(calls=40, train_s=math.nan)
    text = table({"teacher": [teacher, teacher], i2v.LORA_ROW: [result(), result(clip_fd=math.nan)]}, i2v.COLUMNS)
    assert "| 10.00 ± 0.00 |" in text and text.split("| teacher |")[1].split("\n")[0].rstrip().endswith("| nan |")


def test_i2v_rows_are_chosen_by_their_words_and_other_reports_refused(tmp_path, capsys):
    assert [r.name for r in i2v.chosen(["regression"])] == ["cut student, dmd + regression 0.1, 4 steps"]
    assert len(i2v.chosen(["cut"])) == 2
    for argv, words in (
        (["--teacher", "pocket_i2v", "--rows", "nothing"], "no row's name holds these words"),
        (["--teacher", "pocket_i2v", "--fewstep"], "--teacher pocket_i2v runs the video comparison"),
    ):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--out", str(tmp_path / "q.md")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err and err.count("\n") == 1
    assert not (tmp_path / "q.md").exists()


@pytest.mark.slow  # three students trained 2 steps and sampled, through the model's own WanImageToVideoPipeline
def test_a_small_i2v_comparison_trains_samples_from_given_frames_and_writes_its_section(tmp_path):
    out = tmp_path / "q.md"
    main(["--teacher", "pocket_i2v", "--small", "--work", str(tmp_path / "w"), "--out", str(out)])
    text = out.read_text()
    assert "<!-- quality:i2v-pocket_i2v -->" in text and "Targets (issue 42)" in text
    assert "| LoRA student rank 6, dmd, 4 steps | 4 |" in text and "| cut student, dmd, 4 steps | 4 |" in text
    assert "| cut student, dmd + regression 0.1, 4 steps | 4 |" in text  # its ODE from each prompt's image
    row = text.split("| teacher |")[1].split("\n")[0]
    assert not math.isnan(float(row.split("|")[4]))  # the teacher's first-frame PSNR was measured
