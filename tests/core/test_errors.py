"""What the terminal shows when the train CLI cannot run: one line, whoever is at fault."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, cli, fresh_runs

FAST = ["logger=none", "hooks.samples.prompts=0", "hooks.monitor.val_every=0", "~hooks.evaluate",
        "trainer.progress_bar=false", "trainer.max_steps=2"]  # fmt: skip


INJECTED = {"WANDISTILLER_INJECT_FAILURE": "0:1", "HYDRA_FULL_ERROR": "0"}


@pytest.fixture(scope="module", autouse=True)  # autouse: they start with the module, beside its in-process tests
def clis(request, tmp_path_factory, cache_dir, tiny_path):
    """This module's command-line runs, started together (each a fresh process), with the folder each uses."""
    folder = {key: tmp_path_factory.mktemp("cli") for key in ("afile", "bug", "developer")}
    (folder["afile"] / "afile").write_text("x")
    bug = "test_a_bug_is_one_line_saying_how_to_report_it_and_its_traceback_is_in_train_log"
    runs = fresh_runs(request, {
        "afile": ("test_a_run_folder_through_a_file_is_one_line_before_hydra_creates_it",
                  cli(f"hydra.run.dir={folder['afile'] / 'afile' / 'run'}", f"paths.cache_dir={cache_dir}", *FAST)),
        "bug": (bug, cli(f"hydra.run.dir={folder['bug'] / 'r'}", f"paths.cache_dir={cache_dir}", *FAST), INJECTED),
        "developer": (bug, cli(f"hydra.run.dir={folder['developer'] / 'd'}", f"paths.cache_dir={cache_dir}", *FAST),
                      INJECTED | {"HYDRA_FULL_ERROR": "1"}),
    })  # fmt: skip
    return {key: (started, folder[key]) for key, started in runs.items()}


@pytest.mark.slow  # a whole CLI process: the default lane keeps its budget
def test_a_run_folder_through_a_file_is_one_line_before_hydra_creates_it(clis):
    result = clis["afile"][0].result()
    assert result.returncode == 2 and "Traceback" not in result.stderr + result.stdout
    assert result.stderr.strip().splitlines()[-1].startswith("error: hydra.run.dir:")
    assert "which is a file" in result.stderr


@pytest.mark.slow  # a whole CLI process: the default lane keeps its budget
def test_a_bug_is_one_line_saying_how_to_report_it_and_its_traceback_is_in_train_log(clis):
    (result, folder), developer = clis["bug"], clis["developer"][0]
    result, developer = result.result(), developer.result()
    assert result.returncode == 1 and "Traceback" not in result.stderr + result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("internal error: RuntimeError: injected failure at step 1") and "report it" in last
    assert "Traceback" in (folder / "r" / "train.log").read_text()
    assert developer.returncode == 1 and "Traceback" in developer.stderr  # HYDRA_FULL_ERROR=1: the whole story


@pytest.mark.slow
def test_under_torchrun_a_refusal_is_one_line_from_rank_0_and_leaves_no_folder(tmp_path, cache_dir, tiny_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    run_dir = tmp_path / "r"
    result = subprocess.run(
        [torchrun, "--nproc_per_node=2", "-m", "wandistiller.train", "teacher_placement=sharded",
         f"hydra.run.dir={run_dir}", f"paths.cache_dir={cache_dir}", "trainer.batch_size=0", *FAST],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    ours = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and ours == ["error: trainer.batch_size=0 must be a positive integer"]
    assert not run_dir.exists()


BAD_COUNTS = [
    ("--steps", "0", "0 is not 1 or more"),
    ("--steps", "-1", "-1 is not 1 or more"),
    ("--student-steps", "0", "0 is not 1 or more"),
    ("--student-steps", "a", "'a' is not a whole number"),
    ("--student-steps", "1,,2", "is not a whole number"),
    ("--student-steps", "-1", "is not 1 or more"),
]


@pytest.mark.parametrize("tool", ["eval", "generate"])
@pytest.mark.parametrize("option, value, why", BAD_COUNTS)
def test_tools_refuse_a_bad_count_in_one_line_without_the_usage_block(tool, option, value, why, tmp_path, capsys):
    import importlib

    module = importlib.import_module(f"wandistiller.{tool}")
    argv = [str(tmp_path), f"{option}={value}"] + (["--prompt", "a fox"] if tool == "generate" else [])
    with pytest.raises(SystemExit) as e:
        module.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: {option}") and why in err and err.count("\n") == 1, err
    assert "usage:" not in err and not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [["run", "--steps", "2", "--nope"], ["run", "--prompt", "x", "--dtype", "fp8"], []])
def test_what_argparse_refuses_is_one_line_naming_the_help_too(argv, capsys):
    from wandistiller import generate

    with pytest.raises(SystemExit) as e:
        generate.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert err.endswith("; python -m wandistiller.generate --help lists the options\n") and "usage:" not in err


@pytest.mark.parametrize("module", ["eval", "generate", "pipeline", "quality.__main__", "pocket.build"])
def test_every_clis_help_has_its_whole_first_paragraph(module, capsys):
    import importlib

    from wandistiller.core.errors import description

    cli = importlib.import_module(f"wandistiller.{module}")
    whole = description(cli.__doc__)
    assert whole.endswith(".") and "\n" not in whole, whole  # a sentence to its end, not one line of it
    with pytest.raises(SystemExit) as e:
        (cli.parse_args if hasattr(cli, "parse_args") else cli.main)(["--help"])
    assert e.value.code == 0 and whole in " ".join(capsys.readouterr().out.split())


def test_parameter_counts_carry_units():
    from wandistiller.core.errors import human_count

    assert [human_count(n) for n in (512, 41_888, 213_456_789, 999_999, 1_300_000_000)] == [
        "512", "41.9K", "213M", "1M", "1.3B"
    ]  # fmt: skip


def test_a_rate_keeps_three_significant_figures_and_never_reads_zero_for_a_slow_run():
    from wandistiller.core.errors import rate

    assert [rate(x) for x in (0.0123, 0.04, 41.27, 999.7, 1234.5, 0.0, None)] == [
        "0.0123", "0.04", "41.3", "1000", "1234", "0", "0"
    ]  # fmt: skip


def test_a_long_reason_is_clipped_in_its_middle_keeping_what_it_ends_with():
    from wandistiller.core.errors import clipped

    assert clipped("short") == "short"
    long = "/tmp/" + "d" * 1000 + "/tensors.safetensors leads out of the run folder"
    kept = clipped(long)
    assert len(kept) == 801 and kept.startswith("/tmp/ddd") and kept.endswith("leads out of the run folder")
