"""Tests wandistiller/core/stopping.py with real signals, in-process, across two ranks and through the CLI: SIGTERM /
Ctrl-C: a checkpoint at the next step boundary and one line on how to resume; twice: exit now."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from tests.conftest import ROOT, fresh_runs, run_cli
from wandistiller.core.stopping import Stop
from wandistiller.state.checkpoint import list_checkpoints, load_checkpoint


@pytest.mark.slow  # two CLI starts: ~20 s; with the progress bar on, as a user runs it
def test_sigterm_saves_a_checkpoint_says_how_to_resume_and_the_resume_completes(tmp_path, cache_dir, tiny_path):
    run_dir = tmp_path / "r"
    common = [
        f"paths.cache_dir={cache_dir}",
        "logger=none",
        "hooks.samples.prompts=0",
        "~hooks.evaluate",
        "hooks.monitor.val_every=0",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "wandistiller.train", *common, f"hydra.run.dir={run_dir}"]
        + ["trainer.max_steps=100000", "trainer.checkpoint_every=3"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while not list_checkpoints(run_dir) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert list_checkpoints(run_dir), "no progress within 120 s"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:  # never leave a training job behind
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Traceback" not in stderr
    last = [line for line in stderr.splitlines() if line.strip()][-1]  # the progress bar ended before it
    step = load_checkpoint(list_checkpoints(run_dir)[-1])["step"]
    assert last == (
        f"stopped by SIGTERM after step {step}, with a checkpoint; to continue, run the same command with "
        f"trainer.resume=auto hydra.run.dir={run_dir}"
    )
    assert not (run_dir / "metrics.json").exists() and not (run_dir / "student").exists()  # not a finished run
    again = run_cli(*common, f"hydra.run.dir={run_dir}", f"trainer.max_steps={step + 2}", "trainer.resume=auto")
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["final_step"] == step + 2 and summary["steps_this_segment"] == 2


SIGNAL_TWICE = textwrap.dedent(
    """
    import os, signal, sys, time
    from wandistiller.core.stopping import Stop
    stop = Stop().install()
    signum = getattr(signal, sys.argv[1])
    os.kill(os.getpid(), signum)
    time.sleep(0.2)
    print("requested", stop.requested(), flush=True)
    os.kill(os.getpid(), signum)  # an echo of the same request (terminal + launcher): ignored
    time.sleep(0.2)
    print("after the echo", flush=True)
    if len(sys.argv) > 2:
        time.sleep(1.0)  # a second request, later
        os.kill(os.getpid(), signum)
        time.sleep(5)
        print("still alive", flush=True)
    """
)


@pytest.fixture(scope="module", autouse=True)  # autouse: they start with the module, beside its in-process tests
def signalled(request):
    """Two fresh processes that signal themselves (SIGINT once, SIGTERM twice), started together."""
    test = "test_ctrl_c_once_is_a_request_and_twice_exits_at_once"
    return fresh_runs(request, {
        "once": (test, [sys.executable, "-c", SIGNAL_TWICE, "SIGINT"]),
        "twice": (test, [sys.executable, "-c", SIGNAL_TWICE, "SIGTERM", "twice"]),
    })  # fmt: skip


@pytest.mark.slow  # a whole run: the default lane keeps its 4 minutes
def test_ctrl_c_once_is_a_request_and_twice_exits_at_once(signalled):
    once = signalled["once"].result()
    assert once.returncode == 0 and "requested True" in once.stdout and "after the echo" in once.stdout
    assert "SIGINT: stopping after this step" in once.stderr
    twice = signalled["twice"].result()
    assert twice.returncode == -signal.SIGTERM and "still alive" not in twice.stdout
    assert "SIGTERM again: exiting now" in twice.stderr


def _agree_check(paths: dict) -> tuple[bool, bool]:
    """Whether a stop is requested, asked of every rank before and after rank 1 gets SIGTERM (in conftest.two_ranks)."""
    stop = Stop().install()
    before = stop.requested(dist.group.WORLD)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
    after = stop.requested(dist.group.WORLD)
    stop.restore()
    return before, after


def test_every_training_rank_stops_at_the_same_step_when_one_is_signalled(two_ranks):
    assert [r["_agree_check"] for r in two_ranks] == [(False, True), (False, True)]


@pytest.mark.slow  # two CPU workers: ~60 s here
def test_sigterm_to_the_launcher_of_two_workers_stops_both_at_one_step_with_one_line(tmp_path, cache_dir, tiny_path):
    run_dir = tmp_path / "r"
    proc = subprocess.Popen(
        [sys.executable, "-m", "wandistiller.train", f"paths.cache_dir={cache_dir}", f"hydra.run.dir={run_dir}"]
        + [
            "logger=none",
            "hooks.samples.prompts=0",
            "~hooks.evaluate",
            "hooks.monitor.val_every=0",
            "trainer.progress_bar=false",
            "distributed.nproc_per_node=2",
        ]
        + ["trainer.max_steps=100000", "trainer.checkpoint_every=2", "trainer.batch_size=2"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        while not list_checkpoints(run_dir) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert list_checkpoints(run_dir), "no progress within 300 s"
        proc.send_signal(signal.SIGTERM)  # the launcher only, as Kubernetes does
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    stops = [line for line in stderr.splitlines() if line.startswith("stopped by")]
    assert stops == [
        "stopped by SIGTERM; the workers saved a checkpoint at their last step; to continue, run the same "
        f"command with trainer.resume=auto hydra.run.dir={run_dir}"
    ], stderr[-3000:]
    assert "Traceback" not in stderr and not (run_dir / ".failures").exists()
    assert load_checkpoint(list_checkpoints(run_dir)[-1])["step"] >= 2


@pytest.mark.slow  # a CLI start and part of a compile: ~20 s
def test_sigterm_while_the_first_step_compiles_exits_within_ten_seconds_in_one_line(tmp_path, cache_dir, tiny_path):
    run_dir = tmp_path / "r"
    proc = subprocess.Popen(
        [sys.executable, "-m", "wandistiller.train", f"paths.cache_dir={cache_dir}", "logger=none",
         "hooks.samples.prompts=0", "~hooks.evaluate", "hooks.monitor.val_every=0", "trainer.progress_bar=false",
         "teacher.compile=true", "trainer.compile_student=true", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 120
        log = run_dir / "train.log"
        while time.time() < deadline and proc.poll() is None:
            if log.is_file() and "compiling the teacher's block graph" in log.read_text():
                break
            time.sleep(0.1)
        assert proc.poll() is None, "the run ended before it compiled"
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        took = time.time() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert took < 10 and proc.returncode == 128 + signal.SIGTERM, (took, stderr[-2000:])
    assert "Traceback" not in stderr and "compiled the teacher's block graph" not in log.read_text()
    last = [line for line in stderr.splitlines() if line.strip()][-1]  # the progress bar ended before it
    assert last.startswith("stopped by SIGTERM before a training step could finish") and "no checkpoint" in last
    assert not list_checkpoints(run_dir)


def test_a_signal_outside_the_training_steps_is_one_line_even_through_broad_excepts(tiny_path, tmp_path):
    """Setup and the tools have no step end to wait for: SIGTERM stops at once with one line, and no
    `except Exception` on its way (a component load, a cache read) turns it into another error."""
    from wandistiller.core.errors import Stopped
    from wandistiller.core.stopping import stop_at_once
    from wandistiller.teacher.spec import inspect_teacher, loading

    spec, before = inspect_teacher(tiny_path), signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped, match=r"stopped by SIGTERM before a training step could finish; kept") as e:
        with stop_at_once("kept"):
            with loading(spec, "VAE"):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
    assert e.value.exit_code == 128 + signal.SIGTERM and signal.getsignal(signal.SIGTERM) == before


@pytest.mark.slow
def test_sigterm_while_the_teacher_latents_are_made_is_one_line_and_keeps_finished_chunks(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "wandistiller.train", f"hydra.run.dir={run_dir}", f"paths.cache_dir={tmp_path}/c",
            "logger=none", "data=teacher_latents", "data.sample_steps=50", "data.latent_chunk=4",
            "trainer.max_steps=1", "hooks.samples.prompts=0"]  # fmt: skip
    proc = subprocess.Popen(args, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 300
    while not list((tmp_path / "c").glob("teacher_latents/*/chunk_*.pt")) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 128 + signal.SIGTERM
    # One line, whichever handler caught it first (the recipe's before-the-first-step one, or setup's own)
    stops = [line for line in err.splitlines() if line.startswith("stopped by SIGTERM before")]
    assert len(stops) == 1 and (
        "nothing to save, no checkpoint written" in stops[0] or "what was saved is kept" in stops[0]
    )
    assert "Traceback" not in err
    assert list((tmp_path / "c").glob("teacher_latents/*/chunk_*.pt"))


def test_a_tools_session_makes_a_mistake_one_line_and_a_sigterm_one_line_saying_what_is_kept(capsys):
    import os
    import signal

    from wandistiller.core.errors import UserError
    from wandistiller.core.stopping import tool_session

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as done, tool_session(stop="nothing was written"):
        raise UserError("--steps 0 must be positive")
    assert done.value.code == 2 and capsys.readouterr().err == "error: --steps 0 must be positive\n"
    with pytest.raises(SystemExit) as done, tool_session(stop="nothing was written"):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
    err = capsys.readouterr().err
    assert done.value.code == 128 + signal.SIGTERM and err.count("\n") == 1 and "nothing was written" in err
    assert signal.getsignal(signal.SIGTERM) is before  # restored: the tool's handler is gone


def test_a_stopped_sweep_point_is_told_to_continue_through_its_sweep(tmp_path):
    # An audit's: "the same command with hydra.run.dir=<point>" under -m started a new sweep from step 0.
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    from wandistiller.config import CONF_DIR
    from wandistiller.core.stopping import how_to_continue

    assert (
        how_to_continue(tmp_path / "run")
        == f"run the same command with trainer.resume=auto hydra.run.dir={tmp_path}/run"
    )
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("train", [f"hydra.sweep.dir={tmp_path / 'sweep'}"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.mode = RunMode.MULTIRUN
    HydraConfig.instance().set_config(cfg)
    try:
        said = how_to_continue(tmp_path / "sweep" / "0")
    finally:
        HydraConfig.instance().cfg = None
    assert said == f"run the same sweep (-m) with trainer.resume=auto hydra.sweep.dir={tmp_path / 'sweep'}"
