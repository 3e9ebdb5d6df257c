"""Tests wandistiller/bench/__main__.py: its flag checks in-process, its defaults and a run in fresh processes.
Where the benchmarks write: under outputs/bench/ (git-ignored, beside the runs), built teachers under
WANDISTILLER_CACHE as for training; never the repository root."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT
from wandistiller.bench.__main__ import check_args, parser
from wandistiller.core.errors import UserError

DEFAULTS = (
    "from wandistiller.bench.__main__ import parser; import json; p = parser(); print(json.dumps({s: vars("
    "p.parse_args([s] + (['--arch', 'tiny'] if s == 'job' else []))) for s in ('overhead', 'teacher', 'load', 'job', "
    "'plan', 'grad-check')}))"
)


@pytest.mark.slow  # a whole CLI process: the default lane keeps its budget
def test_every_bench_defaults_to_outputs_bench_and_the_cache_setting(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDISTILLER_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", DEFAULTS], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    for name, args in json.loads(done.stdout).items():
        assert args["out"] == f"outputs/bench/{name}.json"
        for key in ("cache_dir", "folder"):
            assert args.get(key) is None or args[key].startswith(str(tmp_path / "cache")), (name, key, args[key])


@pytest.mark.slow
def test_bench_teacher_writes_under_outputs_and_names_its_device(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDISTILLER_CACHE": str(tmp_path / "cache")}
    args = ["teacher", "--arch", "tiny", "--device", "cpu", "--batch", "1", "--reps", "1"]
    args += ["--latent-height", "8", "--latent-width", "8"]
    done = subprocess.run([sys.executable, "-m", "wandistiller.bench", *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json")] == ["outputs/bench/teacher.json"]
    assert json.loads((tmp_path / "outputs/bench/teacher.json").read_text())["device"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["job", "--steps", "0"], "--steps=0 must be 1 or more"),
        (["teacher", "--batch", "1,-8"], "--batch=1,-8 must be sizes"),
        (["overhead", "--reps", "-1"], "--reps=-1 must be 1 or more"),
        (["job", "--warmup", "-1"], "--warmup=-1 must be 0 or more"),
        (["load", "--device", "nonsense"], "--device='nonsense' is not a device"),
        (["overhead", "--out", "/"], "--out /: it is a folder"),
        (["overhead", "--compile"], "overhead --compile compares compiled LoRA steps; add --student lora"),
        (["plan", "--placements", "cpu,nope"], "--placements='nope' is not a teacher_placement option; pick from au"),
        (["plan", "--student", "tiny,huge"], "--student='huge' is not a student option; pick from base, from_json,"),
        # An audit's: a huge size was a reshape traceback, an odd one a PASS of a shape train refuses
        (["grad-check", "--latent-height", "100000"], "--latent-height=100000 must be an even number from 2 to 1024"),
        (["grad-check", "--latent-width", "3"], "--latent-width=3 must be an even number"),
        (["plan", "--latent", "0x8"], "--latent=0x8: each side=0 must be an even number"),  # each row "failed"
    ],
)
def test_bench_flags_are_one_line_before_any_setup(argv, message):
    with pytest.raises(UserError, match=message):
        check_args(parser().parse_args(argv))


def test_bench_never_writes_into_a_run_folder_or_over_a_file_no_benchmark_wrote(tmp_path):
    # An audit's: grad-check --out <run>/metrics.json replaced a finished run's metrics; overhead --cache-dir <run>
    # wrote embeddings/ and teachers/ into it.
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (run / "metrics.json").write_text('{"loss": 1}')
    (tmp_path / "notes.txt").write_text("my notes")
    (tmp_path / "earlier.json").write_text('{"device": "cpu"}')
    for argv, said in (
        (
            ["grad-check", "--out", str(run / "metrics.json")],
            f"lies in the run folder {run}, whose files are the run's",
        ),
        (["grad-check", "--out", str(tmp_path / "notes.txt")], "holds something other than a benchmark's JSON"),
        (["overhead", "--cache-dir", str(run)], f"--cache-dir {run} is or lies in the run folder {run}"),
        (["overhead", "--cache-dir", str(run / "cache")], "is or lies in the run folder"),
    ):
        with pytest.raises(UserError, match=re.escape(said)):
            check_args(parser().parse_args(argv))
    check_args(parser().parse_args(["overhead", "--out", str(tmp_path / "earlier.json")]))  # a result: replaced


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("bench", ["job", "teacher", "plan"])
def test_a_cuda_bench_on_a_cpu_machine_is_one_line(bench):
    with pytest.raises(UserError, match="--device=cuda: this machine has no CUDA GPU"):
        check_args(parser().parse_args([bench, "--device", "cuda"]))


def test_overhead_takes_the_lora_student_and_no_other():
    assert parser().parse_args(["overhead", "--student", "lora"]).student == "lora"
    assert parser().parse_args(["overhead"]).student is None  # the default: the KD loop's tiny student
    with pytest.raises(SystemExit):  # argparse's one line, exit 2
        parser().parse_args(["overhead", "--student", "half"])


@pytest.mark.parametrize(
    "argv, said",
    [
        (["grad-check", "--steps", "x"], "argument --steps: invalid int value: 'x'; python -m wandistiller.bench grad"),
        (["overhead", "--bogus"], "unrecognized arguments: --bogus"),
        (["nope"], "argument bench: invalid choice: 'nope'"),
    ],
)
def test_a_flag_mistake_is_one_line_not_the_usage_block(capsys, argv, said):
    """The bench printed argparse's usage block where every other command prints one `error:` line."""
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and said in err, err
