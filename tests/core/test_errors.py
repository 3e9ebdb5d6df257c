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


def test_a_run_folder_through_a_file_is_one_line_before_hydra_creates_it(clis):
    result = clis["afile"][0].result()
    assert result.returncode == 2 and "Traceback" not in result.stderr + result.stdout
    assert result.stderr.strip().splitlines()[-1].startswith("error: hydra.run.dir:")
    assert "which is a file" in result.stderr


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


@pytest.mark.parametrize("tool", ["eval", "generate"])
def test_tools_refuse_zero_or_negative_steps_in_their_usage_line(tool, capsys):
    import importlib

    module = importlib.import_module(f"wandistiller.{tool}")
    argv = ["run", "--steps", "0"] + (["--prompt", "a fox"] if tool == "generate" else [])
    with pytest.raises(SystemExit) as e:
        module.parse_args(argv)
    assert e.value.code == 2 and "--steps: 0 must be 1 or more" in capsys.readouterr().err


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
