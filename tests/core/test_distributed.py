"""Several processes on the CPU (gloo): served targets, DDP, launching, failures."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from tests.conftest import FP32, ROOT, background_job, cli, job_result, metrics_steps, run_cli, session_env
from wandistiller.core.distributed import Topology
from wandistiller.core.errors import UserError
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.state.checkpoint import load_checkpoint
from wandistiller.student.model import build_student
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.train import run


def _ddp_check(paths: dict) -> list:
    """Each rank's gradients after one DDP step on different data: all equal, none zero (in conftest.two_ranks)."""
    from torch.nn.parallel import DistributedDataParallel

    spec = inspect_teacher(__import__("pathlib").Path(paths["tiny"]))
    torch.manual_seed(0)
    student = build_student(spec, **OmegaConf.create({"builder": "tiny", "config_path": None, "init": "random"}))
    model = DistributedDataParallel(student)
    g = torch.Generator().manual_seed(dist.get_rank())  # different data on each rank
    pred, _ = model(
        torch.randn(2, 16, 1, 8, 8, generator=g),
        torch.rand(2, generator=g) * 1000,
        torch.randn(2, 512, 32, generator=g),
    )
    pred.square().mean().backward()
    grads = torch.cat([p.grad.flatten() for p in student.parameters()])
    gathered = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, grads)
    # Drop DDP's reducer while the group lives, and give gloo's worker thread the GIL to release its last
    # work: a reducer that outlives the group joins that thread while holding the GIL (a torch deadlock).
    del model
    gc.collect()
    time.sleep(0.2)
    return [bool(torch.equal(gathered[0], g)) and bool(g.abs().sum() > 0) for g in gathered]


def test_ddp_gradients_are_equal_across_ranks_after_a_step(two_ranks):
    assert [r["_ddp_check"] for r in two_ranks] == [[True, True], [True, True]]


def _args(run_dir, cache_dir, *extra) -> list[str]:
    return [f"hydra.run.dir={run_dir}", f"paths.cache_dir={cache_dir}", "logger=none", "trainer.progress_bar=false",
            "~hooks.evaluate", "precision=fp32", *extra]  # fmt: skip


def _cli(run_dir, cache_dir, *extra, env=None):
    return run_cli(*_args(run_dir, cache_dir, *extra), env=env)


TRAINS = ["distributed.nproc_per_node=2", "trainer.max_steps=25", "student.init=random", "trainer.optimizer.lr=3e-3",
          "trainer.warmup_steps=0", "hooks.samples.prompts=2", "hooks.samples.steps=2"]  # fmt: skip


def _fail_then_resume(run_dir, aside, cache_dir, env: dict) -> dict:
    """One 2-rank job whose rank 1 fails at step 2, then its resume to the end (25 steps): the failure's
    report, a copy of the checkpoint it left, and a finished 2-rank run, for two tests (two CLI jobs, not four)."""

    def train(*extra, env=env):  # in the environment copied when the job started, whole
        args = cli(*_args(run_dir, cache_dir, *TRAINS, *extra))
        return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)

    failed = train("trainer.checkpoint_every=1", env=env | {"WANDISTILLER_INJECT_FAILURE": "1:2"})
    steps_left = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    shutil.copytree(run_dir / "checkpoints" / "step_00000002", aside / "step_00000002")  # the resume prunes it
    resumed = train("trainer.resume=auto")
    return {"run_dir": run_dir, "failed": failed, "steps_left": steps_left, "left": aside / "step_00000002",
            "resumed": resumed}  # fmt: skip


@background_job("failed_then_resumed")
def _start_failed_then_resumed(request, submit):
    """This module's long job, started with the session (conftest.session_jobs) when a test that reads it runs."""
    cache_dir, factory = request.getfixturevalue("cache_dir"), request.getfixturevalue("tmp_path_factory")
    request.getfixturevalue("tiny_path")
    run_dir, aside = factory.mktemp("two_rank_job") / "r", factory.mktemp("two_rank_job_checkpoint")
    env = session_env(request)  # copied now: a test's monkeypatching never leaks in
    return submit(_fail_then_resume, run_dir, aside, cache_dir, env)


@pytest.fixture(scope="module")
def failed_then_resumed(session_jobs) -> dict:
    return job_result(session_jobs, "failed_then_resumed")


@pytest.mark.slow  # two 2-rank jobs (fail, then resume to step 25); the default lane keeps the 2-rank DDP checks below
def test_a_failing_rank_ends_the_job_quickly_with_its_error_and_its_checkpoints_resume(failed_then_resumed):
    failed, resumed = failed_then_resumed["failed"], failed_then_resumed["resumed"]
    # Quickly: rank 0 stopped at the failed step rather than waiting out the collective's timeout (30 min, past
    # the job's 600 s subprocess timeout), or training on: no checkpoint past step 3. Steps, not seconds: a
    # wall-clock bound failed on a loaded machine while the behaviour was right.
    assert failed.returncode != 0 and failed_then_resumed["steps_left"][-1] <= "step_00000003"
    assert "worker rank 1 failed" in failed.stderr and "injected failure at step 2" in failed.stdout + failed.stderr
    # The checkpoints written before the failure are complete, load, and a 2-rank resume finishes from them.
    assert load_checkpoint(failed_then_resumed["left"])["step"] == 2
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((failed_then_resumed["run_dir"] / "metrics.json").read_text())
    assert summary["final_step"] == 25 and summary["steps_this_segment"] == 23


@pytest.mark.slow  # the same job's run folder
def test_a_two_rank_run_lowers_the_loss_and_writes_one_run_folder(failed_then_resumed):
    run_dir = failed_then_resumed["run_dir"]
    assert failed_then_resumed["resumed"].returncode == 0, failed_then_resumed["resumed"].stderr[-3000:]
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["world_size"] == 2 and summary["training_ranks"] == 2 and summary["batch_size"] == 8
    assert [r["role"] for r in summary["ranks"]] == ["owner + student", "student"]
    rows = metrics_steps(run_dir)
    assert [s["step"] for s in rows] == list(range(1, 26))  # the failed segment's steps, then the resumed ones
    losses = [s["loss"] for s in rows]
    assert sum(losses[-5:]) < 0.6 * sum(losses[:5])
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["r"]
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "samples.png").is_file()


@pytest.mark.slow
def test_gpu0_layout_serves_two_students_from_a_dedicated_owner(tmp_path, cache_dir, tiny_moe_path):
    run_dir = tmp_path / "r"
    result = _cli(
        run_dir,
        cache_dir,
        "teacher=tiny_moe",
        "distributed.nproc_per_node=3",
        "teacher_placement=gpu0",
        "teacher_placement.debug_cpu=true",
        "trainer.max_steps=4",
        "hooks.samples.prompts=1",
        "hooks.samples.steps=2",
        "trainer.loss.hidden_kd_weight=0.1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["placement"] == "gpu0" and summary["training_ranks"] == 2
    assert [r["role"] for r in summary["ranks"]] == ["teacher owner", "student", "student"]
    assert 0 <= summary["owner_idle_fraction"] < 1
    assert (run_dir / "samples.png").is_file()


@pytest.mark.slow  # the default lane: the plain failure above, and the report in one process below
def test_an_out_of_memory_on_one_rank_ends_the_job_with_the_planners_estimates(tmp_path, cache_dir, tiny_path):
    run_dir = tmp_path / "r"
    result = _cli(run_dir, cache_dir, "distributed.nproc_per_node=2", "trainer.max_steps=50",
                  "trainer.checkpoint_every=1", env={"WANDISTILLER_INJECT_FAILURE": "1:2:oom"})  # fmt: skip
    assert result.returncode != 0 and max(p.name for p in (run_dir / "checkpoints").glob("step_*")) <= "step_00000003"
    assert "worker rank 1 failed" in result.stderr and "CUDA out of memory on rank 1" in result.stdout + result.stderr
    assert "planner's estimates" in result.stdout + result.stderr
    assert load_checkpoint(run_dir / "checkpoints" / "step_00000002")["step"] == 2


def test_an_out_of_memory_is_one_report_with_the_planners_estimates_and_keeps_the_checkpoints(
    make_cfg, tmp_path, monkeypatch
):

    monkeypatch.setenv("WANDISTILLER_INJECT_FAILURE", "0:2:oom")
    with pytest.raises(UserError) as e:
        run(make_cfg("trainer.max_steps=5", "trainer.checkpoint_every=1", run_dir=tmp_path / "r"))
    report = str(e.value)
    assert report.startswith("CUDA out of memory on rank 0: injected out-of-memory at step 2\n")
    assert "planner's estimates for this teacher and hardware:" in report and "try: a placement" in report
    assert load_checkpoint(tmp_path / "r" / "checkpoints" / "step_00000002")["step"] == 2


@pytest.mark.slow
def test_a_worker_killed_from_outside_stops_the_others_and_leaves_a_resumable_checkpoint(
    tmp_path, cache_dir, tiny_path
):
    run_dir = tmp_path / "r"
    args = [
        sys.executable,
        "-m",
        "wandistiller.train",
        f"hydra.run.dir={run_dir}",
        f"paths.cache_dir={cache_dir}",
        "logger=none",
        "trainer.progress_bar=false",
        "distributed.nproc_per_node=2",
        "precision=fp32",  # as _cli's resume below says: a resume must agree with the run's saved config
        "trainer.max_steps=100000",
        "trainer.checkpoint_every=5",
        "hooks.samples.prompts=0",
        "~hooks.evaluate",
        "hooks.monitor.val_every=0",
    ]
    proc = subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, start_new_session=True
    )
    try:
        _kill_rank_1_once_a_checkpoint_exists(proc, run_dir)
    finally:  # never leave a training job behind, whatever failed above
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    done = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert load_checkpoint(done)["step"] == int(done.name.split("_")[1])
    again = _cli(
        run_dir,
        cache_dir,
        "distributed.nproc_per_node=2",
        f"trainer.max_steps={int(done.name[5:]) + 2}",
        "trainer.resume=auto",
    )
    assert again.returncode == 0, again.stderr[-3000:]


def _kill_rank_1_once_a_checkpoint_exists(proc, run_dir):
    deadline = time.time() + 120
    while not list((run_dir / "checkpoints").glob("step_*")) and time.time() < deadline:
        time.sleep(0.5)
    victim = int(re.search(r"rank 1 \(pid (\d+)\)", (run_dir / "train_rank1.log").read_text()).group(1))
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode != 0 and time.time() - killed_at < 60
    assert not subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True).stdout  # no orphans left


@pytest.mark.slow
def test_torchrun_ranks_agree_on_one_run_folder(tmp_path, cache_dir, tiny_path):
    out = tmp_path / "outputs"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "wandistiller.train",
            f"paths.cache_dir={cache_dir}",
            "logger=none",
            "trainer.progress_bar=false",
            "trainer.max_steps=3",
            "hooks.samples.prompts=0",
            "~hooks.evaluate",
            "hooks.monitor.val_every=0",
            f"hydra.run.dir={out}/${{wd_now:%H-%M-%S}}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    folders = list(out.iterdir())
    assert len(folders) == 1
    summary = json.loads((folders[0] / "metrics.json").read_text())
    assert summary["world_size"] == 2 and summary["final_step"] == 3
    assert (folders[0] / "train.log").is_file() and (folders[0] / "train_rank1.log").is_file()


def _sharded_check(paths: dict) -> bool:
    """A sharded teacher's targets equal a local teacher's, bit for bit, and each rank holds a shard."""
    from wandistiller.placements.sharded import ShardedPlacement

    topo = Topology.from_env()
    spec = inspect_teacher(__import__("pathlib").Path(paths["moe"]))
    teacher_cfg = OmegaConf.create({"guidance_scale": 4.0, "guidance_scale_2": 3.0})
    sharded = ShardedPlacement().load(spec, teacher_cfg, FP32, topo)
    local = CpuPlacement().load(spec, teacher_cfg, FP32, topo)
    ok = True
    # Rank 0's batch needs both experts, rank 1's only the high-noise one: the collective forwards must still pair up.
    t = torch.tensor([950.0, 100.0]) if topo.rank == 0 else torch.tensor([990.0, 900.0])
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + topo.rank)
        x, cond = torch.randn(2, 16, 1, 8, 8, generator=g), torch.randn(2, 512, 32, generator=g)
        got, got_hidden = sharded.targets(x, t, cond, torch.zeros(2, 512, 32), layers=(0, -1))
        want, want_hidden = local.targets(x, t, cond, torch.zeros(2, 512, 32), layers=(0, -1))
        ok &= bool(torch.equal(got, want) and torch.equal(got_hidden, want_hidden))
    shard_params = sum(p.to_local().numel() for p in sharded.experts[0].blocks.parameters())
    ok &= shard_params < sum(p.numel() for p in local.experts[0].blocks.parameters())
    return ok


def test_a_sharded_teacher_gives_local_targets_bit_for_bit_and_holds_a_shard(two_ranks):
    assert [r["_sharded_check"] for r in two_ranks] == [True, True]


@pytest.mark.slow
def test_a_two_rank_sharded_run_trains(tmp_path, cache_dir, tiny_moe_path):
    run_dir = tmp_path / "r"
    result = _cli(
        run_dir,
        cache_dir,
        "teacher=tiny_moe",
        "teacher_placement=sharded",
        "distributed.nproc_per_node=2",
        "trainer.max_steps=3",
        "hooks.samples.prompts=1",
        "hooks.samples.steps=2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["placement"] == "sharded" and summary["training_ranks"] == 2
    assert (run_dir / "samples.png").is_file()


def test_sharded_with_one_process_is_refused(make_cfg, tmp_path):

    with pytest.raises(UserError, match="teacher_placement=sharded .* distributed.nproc_per_node"):
        run(make_cfg("teacher_placement=sharded", run_dir=tmp_path / "r"))


def _listening(pids: set[int]) -> set[str]:
    """The addresses (hex, as /proc/net shows them) that these processes' TCP sockets listen on."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:  # 0A: LISTEN
                found.add(parts[1].rsplit(":", 1)[0])
    return found


def _listening_check(paths: dict) -> dict:
    """An all-reduce's sum, and the addresses this rank and its launcher listen on (in conftest.two_ranks)."""
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"sum": t.item(), "listening": sorted(_listening({os.getpid(), os.getppid()}))}


def test_a_single_node_launch_listens_on_the_loopback_only(two_ranks):
    """The rendezvous, the workers' store and gloo: nothing a single-node run opens is reachable from
    another machine (torch's own stores bind every interface whatever host they are given)."""
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
    found = [r["_listening_check"] for r in two_ranks]
    assert [r["sum"] for r in found] == [2.0, 2.0]
    assert all(r["listening"] and set(r["listening"]) <= loopback for r in found), found
    assert "WANDISTILLER_LOOPBACK_STORE" not in os.environ  # the environment is restored


def test_made_once_makes_on_one_rank_and_reads_on_the_others():
    from wandistiller.core.distributed import Topology, made_once

    calls = []
    assert made_once(Topology(), lambda: calls.append("make") or 1, lambda: calls.append("read") or 2) == 1
    assert made_once(Topology(), lambda: 1, lambda: calls.append("read") or 2, makes=False) == 2
    assert calls == ["make", "read"]


def test_a_launch_marks_its_workers_and_leaves_this_process_as_it_was(monkeypatch):
    from wandistiller.core.distributed import launched_env

    monkeypatch.delenv("WANDISTILLER_LAUNCHED", raising=False)
    with launched_env():
        assert os.environ["WANDISTILLER_LAUNCHED"] == "1"  # what the spawned workers inherit
    assert "WANDISTILLER_LAUNCHED" not in os.environ  # a later run in this process says its own stop
    monkeypatch.setenv("WANDISTILLER_LAUNCHED", "0")
    with launched_env():
        pass
    assert os.environ["WANDISTILLER_LAUNCHED"] == "0"
