"""`wandistiller.quality.__main__`: cells, table, targets, report, settings from numbers; the command (slow)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from wandistiller.quality.__main__ import cell, parse_args, report, settings_from, table, targets
from wandistiller.quality.compare import COLUMNS, ROWS, Settings


def scores(accuracy: float, fid: float, **more) -> dict:
    """One seed's row as `compare` returns it."""
    return {"prompt_accuracy": accuracy, "fid": fid, "kid": 0.01, "latent_mse": 0.002, "params": 1234.0,
            "s_per_image": 0.05} | more  # fmt: skip


def results(*rows: tuple[float, float]) -> dict[str, list[dict]]:
    """{teacher, then ROWS in order: [one seed's scores]} from (prompt accuracy, fid) pairs."""
    names = ["teacher"] + [name for name, _ in ROWS]
    return {name: [scores(accuracy, fid)] for name, (accuracy, fid) in zip(names, rows, strict=True)}


@pytest.mark.slow
def test_the_comparison_command_runs_small(tmp_path, cache_dir):
    out = tmp_path / "QUALITY.md"
    result = subprocess.run([sys.executable, "-m", "wandistiller.quality", "--small", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    text = out.read_text()
    for row in ("| teacher |", "Gaussian x0", "teacher latents", "images", "no teacher", "blend"):
        assert row in text


def test_a_cell_is_the_mean_over_seeds_with_the_population_spread_in_the_columns_format():
    assert cell([0.5], "prompt_accuracy") == "50.0%"  # one seed: no spread
    assert cell([0.5, 0.7], "prompt_accuracy") == "60.0% ± 10.0"  # the spread without a second %
    assert cell([1.0, 2.0, 3.0], "fid") == "2.00 ± 0.82"
    assert cell([0.01, 0.03], "kid") == "0.020 ± 0.010"
    assert cell([1000, 3000], "params") == "2,000"  # the same student every seed: never a spread


def test_the_table_has_one_row_per_setting_and_leaves_a_column_a_row_lacks_empty():
    rows = {
        "teacher": [scores(0.9, 2.0)],
        "distilled, images": [scores(0.8, 3.0, train_s=10), scores(0.6, 5.0, train_s=30)],
    }
    lines = table(rows).splitlines()
    assert lines[0] == "| | " + " | ".join(COLUMNS + ["train_s"]) + " |"
    assert lines[1] == "|---" * 8 + "|" and len(lines) == 4
    assert lines[2] == "| teacher | 90.0% | 2.00 | 0.010 | 0.0020 | 1,234 | 0.050 |  |"  # the teacher is not trained
    assert lines[3].startswith("| distilled, images | 70.0% ± 10.0 | 4.00 ± 1.00 |")
    assert lines[3].endswith("| 20 ± 10 |")


def test_every_target_is_met_when_the_students_are_near_the_teacher_and_distilling_helps():
    # teacher, Gaussian x0, teacher latents, images, no teacher, blend: (prompt accuracy, fid)
    lines = targets(results((0.95, 2.0), (0.85, 2.5), (0.9, 2.2), (0.9, 2.1), (0.5, 6.0), (0.8, 3.0)))
    assert lines[0] == "- teacher's guided samples >= 90% prompt accuracy: 95.0%, met"
    assert lines[1].startswith("- distilled, Gaussian x0: 89% of the teacher's accuracy") and "FID 1.25x" in lines[1]
    assert len(lines) == 6 and all(line.endswith("met") and "MISSED" not in line for line in lines)


def test_each_target_a_result_falls_short_of_is_missed():
    # A weak teacher; latents at 75% of its accuracy and worse than Gaussian x0; the images student's FID 1.6x;
    # no teacher beats distilling.
    lines = targets(results((0.8, 2.0), (0.8, 2.0), (0.6, 2.5), (0.8, 3.2), (0.9, 2.0), (0.8, 3.0)))
    assert [line.rsplit(" ", 1)[-1] for line in lines] == ["MISSED", "met", "MISSED", "MISSED", "MISSED", "MISSED"]
    assert "FID 1.60x the teacher's" in lines[3]


def test_small_sets_the_ci_sized_settings_and_explicit_numbers_win_over_the_defaults():
    assert settings_from(parse_args([])) == Settings()
    small = settings_from(parse_args(["--small", "--teacher", "pocket_moe"]))
    assert (small.seeds, small.max_steps, small.batch_size, small.prompts) == ((0,), 2, 2, 6)
    assert small.teacher == "pocket_moe" and small.sample_steps == 2 and small.extra == ()
    given = settings_from(parse_args(["--small", "--seeds", "4", "5", "--steps", "30", "--batch-size", "8"]))
    assert (given.seeds, given.max_steps, given.batch_size, given.sample_steps) == ((4, 5), 30, 8, 2)
    with pytest.raises(SystemExit):
        parse_args(["--teacher", "tiny"])  # only the pocket teachers have a judge


def test_the_report_names_the_command_and_the_settings_and_holds_the_table_and_targets():
    settings = settings_from(parse_args(["--small"]))
    numbers = results((0.95, 2.0), (0.85, 2.5), (0.9, 2.2), (0.9, 2.1), (0.5, 6.0), (0.8, 3.0))
    text = report(numbers, settings, ["--small"], seconds=90)
    assert text.startswith("Written by ")
    assert "`python -m wandistiller.quality --small`" in text and "1.5 min in all" in text
    assert "`student=half`, 2 steps of batch 2" in text and "1 per prompt x 6 prompts per seed" in text
    assert table(numbers) in text and text.endswith("\n".join(targets(numbers)) + "\n")


def test_a_bad_out_is_refused_before_the_work_and_small_never_writes_the_shipped_report(tmp_path, capsys):
    from wandistiller.quality.__main__ import SHIPPED_REPORT, SMALL_OUT, main, report_path

    assert report_path(parse_args(["--small"])) == SMALL_OUT and report_path(parse_args([])).name == "QUALITY.md"
    shipped = SHIPPED_REPORT.read_bytes()
    (tmp_path / "a_file").write_text("mine")
    (tmp_path / "weights.safetensors").write_bytes(b"\x80\xff" * 8)
    run = tmp_path / "run"  # an audit's --out run/metrics.json: appended to, then read as damaged by the run's tools
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (run / "metrics.json").write_text("{}")
    for out, message in [
        (SHIPPED_REPORT, "--small's numbers mean nothing and would replace the shipped report"),
        (tmp_path, "is a folder; choose another file"),
        (tmp_path / "a_file" / "QUALITY.md", "a_file is a file; choose another file"),
        (run / "metrics.json", f"lies in the run folder {run}, whose files are the run's; choose a file outside it"),
        (run / "student" / "q.md", f"lies in the run folder {run}"),
        (tmp_path / "a_file", "a_file is a file no quality run wrote (it holds no '<!-- quality:…' section)"),
        (tmp_path / "weights.safetensors", "weights.safetensors is a file no quality run wrote"),
    ]:
        with pytest.raises(SystemExit) as e:  # at once: compare() would train for minutes first
            main(["--small", "--work", str(tmp_path / "work"), "--out", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and message in err, err
    assert SHIPPED_REPORT.read_bytes() == shipped and not (tmp_path / "work").exists()
    assert (run / "metrics.json").read_text() == "{}" and (tmp_path / "a_file").read_text() == "mine"


def test_a_style_that_is_no_lora_of_the_teacher_is_refused_before_the_work(tmp_path, capsys):
    from wandistiller.quality.__main__ import main

    (tmp_path / "style.safetensors").write_bytes(b"{}")  # an audit's: refused after the teacher's ODE points
    with pytest.raises(SystemExit) as e:
        main(["--stacking", "--small", "--style", str(tmp_path / "style.safetensors"), "--out", str(tmp_path / "q.md")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: --style: "), err
    assert "is not a safetensors LoRA file" in err and sorted(p.name for p in tmp_path.iterdir()) == [
        "style.safetensors"
    ]


@pytest.mark.parametrize(
    "args,line",
    [  # issue 41: 0 read as unset (the defaults ran in its place); a bad seed was refused minutes in, as `seed=`
        (["--steps", "0"], "--steps 0 is not 1 or more; give a whole number of 1 or more, e.g. --steps 2"),
        (["--batch-size", "0"], "--batch-size 0 is not 1 or more"),
        (["--steps", "-5"], "--steps -5 is not 1 or more"),
        (["--jobs", "0"], "--jobs 0 is not 1 or more"),
        (["--seeds", "0", "-1"], "--seeds -1 is not in [0, 2**63); give whole numbers of 0 or more"),
        # An audit's: "± 0.0" over one seed twice; flags of another report dropped without a word
        (["--seeds", "0", "1", "0"], "--seeds repeats 0: each seed is one sample of the mean"),
        (["--style", "nope.safetensors"], "--style is --stacking's style LoRA; add --stacking, or drop --style"),
        (["--jobs", "3"], "--jobs 3 trains --compression's sizes at once; add --compression, or drop --jobs"),
        (["--student", "bogus"], "argument --student: invalid choice: 'bogus' (choose from 'base', "),  # composition's
    ],
)
def test_a_count_out_of_range_is_named_by_its_flag_before_the_work(tmp_path, capsys, args, line):
    from wandistiller.quality.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--small", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "q.md"), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: {line}") and not list(tmp_path.iterdir())  # nothing made, no report


def test_a_work_folder_in_a_run_or_a_file_is_named_by_its_flag(tmp_path, capsys):
    # An audit's: refused as paths.cache_dir=… or hydra.run.dir=…, words the user never typed
    from wandistiller.quality.__main__ import main

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "a_file").write_text("mine")
    for work, said in ((run, f"--work {run} is or lies in the run folder {run}"),
                       (run / "work", f"--work {run / 'work'} is or lies in the run folder {run}"),
                       (tmp_path / "a_file", f"--work {tmp_path / 'a_file'} is a file")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            main(["--small", "--work", str(work), "--out", str(tmp_path / "q.md")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"error: {said}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "run"]


def test_a_section_is_replaced_between_its_markers_and_the_rest_of_the_report_is_kept(tmp_path):
    from wandistiller.quality.__main__ import write_section

    out = tmp_path / "QUALITY.md"
    write_section(out, "data", "first table")
    write_section(out, "compression", "a curve")
    out.write_text(out.read_text() + "\n## Hand-written notes\n")
    write_section(out, "data", "second table\n")
    text = out.read_text()
    assert text.startswith("# Student quality on the pocket teacher\n")
    assert "first table" not in text and text.count("second table") == 1 and "a curve" in text
    assert text.index("second table") < text.index("a curve") < text.index("## Hand-written notes")
    # The shipped report's generated part is a section: a new run replaces it and keeps the notes after it.
    from wandistiller.quality.__main__ import SHIPPED_REPORT

    shipped = SHIPPED_REPORT.read_text()
    assert "<!-- quality:data -->" in shipped and "<!-- /quality:data -->" in shipped


def test_the_report_shows_the_command_without_this_machines_paths():
    from wandistiller.quality.__main__ import shown

    assert (
        shown(["--compression", "--work", "/tmp/w", "--jobs", "2", "--out=/home/me/Q.md"]) == "--compression --jobs 2"
    )


@pytest.mark.parametrize("out", ["/proc/QUALITY.md", "/sys/QUALITY.md", "/sys/fs/wd/QUALITY.md"])
def test_an_out_that_cannot_be_written_is_tried_and_refused_before_the_work(tmp_path, capsys, out):
    """Permission bits say root may write there; making a file there says otherwise, in one line, at once (the
    report used to fail after 35 minutes of training)."""
    from wandistiller.quality.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--small", "--work", str(tmp_path / "work"), "--out", out])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "cannot be written" in err and "--out" in err, err
    assert not (tmp_path / "work").exists()


def test_stacking_takes_rows_by_word_and_refuses_another_report_teacher_or_row_before_the_work(tmp_path, capsys):
    from wandistiller.quality.__main__ import main

    assert parse_args(["--stacking", "--rows", "simple"]).stacking
    for argv, message in [
        (["--stacking", "--fewstep"], "are separate reports"),
        (["--stacking", "--teacher", "pocket_moe"], "--stacking measures the image teacher's LoRA student"),
        (["--stacking", "--rows", "nothing"], "--rows nothing names no --stacking row"),
        (["--rows", "simple"], "--rows chooses rows of the video or --stacking comparison"),
    ]:
        with pytest.raises(SystemExit) as e:
            main([*argv, "--work", str(tmp_path / "work"), "--out", str(tmp_path / "q.md")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "work").exists()
