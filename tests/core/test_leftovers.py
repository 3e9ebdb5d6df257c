"""What killed processes leave is removed on the next start: only our names, only when the owner is gone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT
from wandistiller.core import leftovers
from wandistiller.core.distributed import Topology
from wandistiller.job.rundir import claim_run_dir
from wandistiller.placements.disk_source import converted_copy
from wandistiller.state.checkpoint import TMP, checkpoint_dir, list_checkpoints, save_checkpoint
from wandistiller.teacher.tiny import build_pattern, ensure_tiny_teacher


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def name(prefix: str, pid: int, host: str = leftovers.HOST) -> str:
    return f"{prefix}-{host}-{pid}"


def test_only_our_names_whose_owner_is_gone_on_this_host_are_removed(tmp_path, dead_pid, live_pid):
    keep = [
        name(".tmp-step_00000004", live_pid),  # still writing
        name(".tmp-step_00000004", dead_pid, host="other-node"),  # cannot be checked from here
        name(".tmp-mine", dead_pid),  # not a name of ours
        "step_00000002",
    ]
    gone = [name(".tmp-step_00000004", dead_pid), name(".tmp-step_00000008", dead_pid)]
    for n in keep + gone:
        (tmp_path / n).mkdir()
        (tmp_path / n / "f").write_text("x")
    removed = leftovers.remove_dead(tmp_path, TMP)
    assert sorted(p.name for p in removed) == sorted(gone)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep)


def test_a_host_name_with_dashes_parses():
    assert leftovers.owner(".tmp-step_00000001-gpu-node-07-4242", TMP) == ("gpu-node-07", 4242)
    assert leftovers.owner(".tmp-step_00000001-4242", TMP) is None


def test_claiming_a_run_folder_cleans_what_killed_saves_and_prunes_left(tmp_path, dead_pid, live_pid):
    run_dir = tmp_path / "r"
    state = {"student": {"w": torch.ones(2)}, "optimizer": {}, "lr_scheduler": {}, "scaler": {}, "ema": None}
    save_checkpoint(run_dir, 2, state | {"tracker_run_id": None}, keep=5)
    root = run_dir / "checkpoints"
    for n in (name(".tmp-step_00000004", dead_pid), name(".prune-step_00000001", dead_pid)):
        (root / n).mkdir()
        (root / n / "tensors.safetensors").write_bytes(b"half")
    (root / name(".tmp-step_00000006", live_pid)).mkdir()
    (root / "step_00000003").mkdir()  # emptied by an interrupted prune
    (root / "step_00000005").mkdir()
    (root / "step_00000005" / "tensors.safetensors").write_bytes(b"half")  # its state.json went first
    (root / "step_00000007").mkdir()
    (root / "step_00000007" / "notes.txt").write_text("a user's file: not ours to remove")
    assert claim_run_dir(run_dir, "auto") == checkpoint_dir(run_dir, 2)
    assert sorted(p.name for p in root.iterdir()) == sorted(
        ["step_00000002", "step_00000007", name(".tmp-step_00000006", live_pid)]
    )
    assert list_checkpoints(run_dir) == [checkpoint_dir(run_dir, 2)]


def test_the_tiny_teachers_dead_build_folder_is_removed(tmp_path, dead_pid, live_pid):
    path = tmp_path / "teachers" / "tiny-wan-t2v"
    path.parent.mkdir(parents=True)
    dead, live = (
        path.parent / name(".tiny-wan-t2v.build", dead_pid),
        path.parent / name(".tiny-wan-t2v.build", live_pid),
    )
    for folder in (dead, live):
        folder.mkdir()
        (folder / "model_index.json").write_text("{")
    assert leftovers.owner(dead.name, build_pattern(path)) == (leftovers.HOST, dead_pid)
    ensure_tiny_teacher(path)
    assert (path / "model_index.json").is_file()
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, live.name])


def test_the_disk_placements_dead_partial_conversions_are_removed(tmp_path, tiny_path, dead_pid, live_pid):
    offload = tmp_path / "offload"
    offload.mkdir()
    dead = offload / name("transformer-bfloat16-0123456789ab.partial", dead_pid)
    live = offload / name("transformer-bfloat16-0123456789ab.partial", live_pid)
    other = offload / name("transformer-bfloat16.partial", dead_pid)  # not a name converted_copy makes
    for folder in (dead, live, other):
        folder.mkdir()
        (folder / "blocks-000.safetensors").write_bytes(b"half")
    target = converted_copy(tiny_path / "transformer", torch.bfloat16, str(offload), Topology())
    assert target.parent == offload and (target / "config.json").is_file()
    assert sorted(p.name for p in offload.iterdir()) == sorted([target.name, live.name, other.name])


SAVER = """
import sys, torch
from pathlib import Path
from wandistiller.state.checkpoint import save_checkpoint, list_checkpoints, checkpoint_step
run = Path(sys.argv[1])
start = checkpoint_step(list_checkpoints(run)[-1]) if list_checkpoints(run) else 0
state = {"student": {f"w{i}": torch.randn(256, 1024) for i in range(8)}, "optimizer": {}, "lr_scheduler": {},
         "scaler": {}, "ema": None, "tracker_run_id": None}
print("ready", flush=True)
for step in range(start + 1, start + 100000):
    save_checkpoint(run, step, state, keep=2)
"""


@pytest.mark.slow  # a whole CLI process: the default lane keeps its budget
def test_kill_9_at_random_moments_of_saving_leaves_usable_checkpoints_and_no_leftovers(tmp_path):
    import random
    import signal
    import time

    from wandistiller.state.checkpoint import clean_leftovers, load_checkpoint, problem

    rng = random.Random(0)
    for _ in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER, str(tmp_path)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.8))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        clean_leftovers(tmp_path)
        found = list_checkpoints(tmp_path)
        assert found and not [c for c in found if problem(c)]
        assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]
        load_checkpoint(found[-1])
