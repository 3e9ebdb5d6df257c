"""Several processes on the CPU (gloo): served targets, DDP, launching, failures."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from conftest import FP32, ROOT, run_cli, spawn
from omegaconf import OmegaConf

from wandistiller.core.distributed import Topology
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.state.checkpoint import load_checkpoint
from wandistiller.student.model import build_student
from wandistiller.teacher.model import inspect_teacher


def _ddp_worker(teacher_path: str) -> list:
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    spec = inspect_teacher(__import__("pathlib").Path(teacher_path))
    torch.manual_seed(0)
    student = build_student(
        spec, **OmegaConf.create({"builder": "tiny", "config_path": None, "init": "random", "hidden_kd_weight": 0.0})
    )
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
    dist.destroy_process_group()
    return [bool(torch.equal(gathered[0], g)) and bool(g.abs().sum() > 0) for g in gathered]


def test_ddp_gradients_are_equal_across_ranks_after_a_step(tiny_path):
    results = spawn(_ddp_worker, 2, str(tiny_path))
    assert all(all(flags) for flags in results.values())


def _cli(run_dir, cache_dir, *extra, env=None):
    return run_cli(
        f"hydra.run.dir={run_dir}",
        f"paths.cache_dir={cache_dir}",
        "logger=none",
        "trainer.progress_bar=false",
        "trainer.eval_at_end=false",
        "precision=fp32",
        *extra,
        env=env,
    )


def steps(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics_steps.jsonl").read_text().splitlines()]


def test_a_two_rank_run_lowers_the_loss_and_writes_one_run_folder(tmp_path, cache_dir, tiny_path):
    run_dir = tmp_path / "r"
    result = _cli(
        run_dir,
        cache_dir,
        "distributed.nproc_per_node=2",
        "trainer.max_steps=25",
        "student.init=random",
        "trainer.optimizer.lr=3e-3",
        "trainer.warmup_steps=0",
        "trainer.sample_prompts=2",
        "trainer.sample_steps=2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["world_size"] == 2 and summary["training_ranks"] == 2 and summary["batch_size"] == 8
    assert [r["role"] for r in summary["ranks"]] == ["owner + student", "student"]
    losses = [s["loss"] for s in steps(run_dir)]
    assert sum(losses[-5:]) < 0.6 * sum(losses[:5])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]
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
        "trainer.sample_prompts=1",
        "trainer.sample_steps=2",
        "student.hidden_kd_weight=0.1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["placement"] == "gpu0" and summary["training_ranks"] == 2
    assert [r["role"] for r in summary["ranks"]] == ["teacher owner", "student", "student"]
    assert 0 <= summary["owner_idle_fraction"] < 1
    assert (run_dir / "samples.png").is_file()


@pytest.mark.parametrize(
    "kind,expected", [("", "injected failure at step 2"), (":oom", "CUDA out of memory on rank 1")]
)
def test_a_failing_rank_ends_the_job_quickly_with_its_error(tmp_path, cache_dir, tiny_path, kind, expected):
    run_dir = tmp_path / "r"
    start = time.time()
    result = _cli(
        run_dir,
        cache_dir,
        "distributed.nproc_per_node=2",
        "trainer.max_steps=50",
        "trainer.checkpoint_every=1",
        env={"WANDISTILLER_INJECT_FAILURE": f"1:2{kind}"},
    )
    assert result.returncode != 0 and time.time() - start < 90
    assert "worker rank 1 failed" in result.stderr and expected in result.stdout + result.stderr
    if kind:
        assert "planner's estimates" in result.stdout + result.stderr
    # The checkpoints written before the failure are complete and load; how the job failed does not change
    # what it wrote, so one 2-rank resume (the plain failure's) stands for both.
    assert load_checkpoint(run_dir / "checkpoints" / "step_00000002")["step"] == 2
    if kind:
        return
    again = _cli(run_dir, cache_dir, "distributed.nproc_per_node=2", "trainer.max_steps=4", "trainer.resume=auto")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((run_dir / "metrics.json").read_text())["final_step"] == 4


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
        "trainer.sample_prompts=0",
        "trainer.eval_at_end=false",
        "trainer.val_every=0",
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
            "trainer.sample_prompts=0",
            "trainer.eval_at_end=false",
            "trainer.val_every=0",
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


def _sharded_worker(teacher_path: str) -> bool:
    from wandistiller.placements.sharded import ShardedPlacement

    dist.init_process_group("gloo")
    topo = Topology.from_env()
    spec = inspect_teacher(__import__("pathlib").Path(teacher_path))
    teacher_cfg = OmegaConf.create({"guidance_scale": 4.0, "guidance_scale_2": 3.0})
    sharded = ShardedPlacement().load(spec, teacher_cfg, FP32, topo)
    local = CpuPlacement().load(spec, teacher_cfg, FP32, topo)
    ok = True
    # Rank 0's batch needs both experts, rank 1's only the high-noise one: the collective forwards must still pair up.
    t = torch.tensor([950.0, 100.0]) if topo.rank == 0 else torch.tensor([990.0, 900.0])
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + topo.rank)
        x, cond = torch.randn(2, 16, 1, 8, 8, generator=g), torch.randn(2, 512, 32, generator=g)
        got, got_hidden = sharded.targets(x, t, cond, torch.zeros(2, 512, 32), want_hidden=True)
        want, want_hidden = local.targets(x, t, cond, torch.zeros(2, 512, 32), want_hidden=True)
        ok &= bool(torch.equal(got, want) and torch.equal(got_hidden, want_hidden))
    shard_params = sum(p.to_local().numel() for p in sharded.experts[0].blocks.parameters())
    ok &= shard_params < sum(p.numel() for p in local.experts[0].blocks.parameters())
    dist.destroy_process_group()
    return ok


def test_a_sharded_teacher_gives_local_targets_bit_for_bit_and_holds_a_shard(tiny_moe_path):
    assert all(spawn(_sharded_worker, 2, str(tiny_moe_path)).values())


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
        "trainer.sample_prompts=1",
        "trainer.sample_steps=2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["placement"] == "sharded" and summary["training_ranks"] == 2
    assert (run_dir / "samples.png").is_file()


def test_sharded_with_one_process_is_refused(make_cfg, tmp_path):
    from wandistiller.core.errors import UserError
    from wandistiller.train import run

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


def _listening_worker() -> list:
    from wandistiller.core.distributed import destroy_process_group, init_process_group

    init_process_group(Topology.from_env(), 1.0)
    t = torch.ones(1)
    dist.all_reduce(t)
    addresses = _listening({os.getpid(), os.getppid()})
    dist.barrier()
    destroy_process_group()
    return [t.item(), sorted(addresses)]


def test_a_single_node_launch_listens_on_the_loopback_only():
    """The rendezvous, the workers' store and gloo: nothing a single-node run opens is reachable from
    another machine (torch's own stores bind every interface whatever host they are given)."""
    from wandistiller.core.distributed import launch

    cfg = OmegaConf.create({"nnodes": 1, "nproc_per_node": 2, "rdzv_endpoint": None, "rdzv_id": None})
    results = launch(_listening_worker, (), cfg)
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
    assert [r[0] for r in results] == [2.0, 2.0]
    assert all(r[1] and set(r[1]) <= loopback for r in results), results
    assert "WANDISTILLER_LOOPBACK_STORE" not in os.environ  # the environment is restored
