"""`wandistiller.quality.stacking`: its rows, their choice by words, and issue 44's targets from known numbers."""

from __future__ import annotations

import pytest

from wandistiller.quality.stacking import ROWS, STYLED_TEACHER, TEACHER, TRAININGS, chosen, targets


def one(accuracy: float, brightness: float, kept: float | None = None) -> dict:
    return {"prompt_accuracy": accuracy, "style_brightness": brightness, "fid": 100.0, "calls": 4.0} | (
        {} if kept is None else {"style_kept": kept}
    )


def test_the_rows_sample_the_plain_student_at_both_schedules_and_the_three_stacks():
    assert TRAININGS["simple"][-1] == "method.schedule=simple" and "method.steps=4" in TRAININGS["plain"]
    styled = dict(o.split("=", 1) for o in TRAININGS["styled"])  # the fine-tuned teacher's settings, each key once
    assert len(styled) == len(TRAININGS["styled"]) and styled["student.rank"] == "16"
    assert styled["trainer.optimizer.lr"] == "2e-3" and styled["method.steps"] == "4"
    assert [r.name for r in chosen(["simple"])] == [ROWS[1].name, ROWS[2].name]
    assert [r.name for r in chosen(["style"])] == [r.name for r in ROWS[3:]]
    assert chosen(None) == ROWS and chosen(["nothing"]) == []
    assert (
        [r.schedule for r in ROWS[:3]] == [None, "simple", None]
        and ROWS[4].stacked
        and ROWS[3].stacked
        and not ROWS[3].student
    )


def test_the_targets_compare_the_schedules_and_what_the_distilled_student_keeps_of_the_styled_teacher():
    results = {
        TEACHER: [one(0.9, 0.05)],
        ROWS[0].name: [one(0.86, 0.05), one(0.88, 0.05)],
        ROWS[1].name: [one(0.80, 0.05), one(0.84, 0.05)],
        STYLED_TEACHER: [one(0.9, 0.85, 1.0)],
        ROWS[4].name: [one(0.8, 0.45, 0.5)],
        ROWS[5].name: [one(0.87, 0.80, 0.94)],
    }
    lines = targets(results)
    assert lines[0] == ("- the 4-step LoRA at its trained sigmas 87.0% against 82.0% at ComfyUI's simple ones "
                        "(target: at least as well): met")  # fmt: skip
    assert lines[1] == ("- the 4-step LoRA distilled from the styled teacher keeps 94% of its style (target >= 90%) "
                        "and 97% of its prompt accuracy (target >= 95%): met")  # fmt: skip
    assert lines[2].startswith("- the plain 4-step LoRA stacked with the style LoRA keeps 50% of the style at 80.0%")
    results[ROWS[5].name] = [one(0.8, 0.80, 0.94)]  # 89% of the styled teacher's accuracy
    assert targets(results)[1].endswith(": MISSED")


@pytest.mark.slow
def test_the_plain_teachers_row_comes_from_a_plain_run_when_only_the_styled_rows_are_chosen(tmp_path):
    """The styled run's teacher has the style merged: sampled as "teacher, 20 steps", it reported the styled teacher
    under the plain one's name (and no style kept could be computed)."""
    from wandistiller.quality.compare import Settings
    from wandistiller.quality.stacking import FOLDERS, compare_stacking

    small = Settings(seeds=(0,), max_steps=2, batch_size=2, sample_steps=2, per_prompt=1, prompts=6)
    results = compare_stacking(small, tmp_path, chosen(["LoRA distilled"]), log=lambda _: None)
    assert (tmp_path / "seed0" / FOLDERS["plain"] / "metrics.json").is_file()
    plain, styled = results[TEACHER][0], results[ROWS[5].name][0]
    assert plain["style_brightness"] > styled["style_brightness"] + 0.05  # the style darkens the digits
