"""Tests wandistiller/job/failures.py directly: what each rank records of its error, which failed rank `root_cause`
names (the first real error, not a survivor's broken connection; the launcher's view included, through real
torch elastic ProcessFailure records) and the one out-of-memory report."""

from __future__ import annotations

import json

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from wandistiller.core.errors import UserError
from wandistiller.job.failures import FAILURES, oom_report, record_failure, root_cause


def raised(error: BaseException) -> BaseException:
    """`error` as it arrives in an except clause (a SystemExit raised while handling another keeps it as context)."""
    try:
        raise error
    except BaseException as e:
        return e


def test_each_rank_records_the_first_line_of_its_error_and_a_user_error_without_its_type(tmp_path):
    record_failure(tmp_path, 0, RuntimeError("shapes differ\n  a traceback line"))
    record_failure(tmp_path, 1, UserError("data.latent_height=3 must be even"))
    try:
        raise ValueError("the cause")
    except ValueError:
        exit_error = raised(SystemExit(1))  # what an exit while handling the real error leaves
    record_failure(tmp_path, 2, exit_error)
    saved = {p.name: json.loads(p.read_text()) for p in (tmp_path / FAILURES).iterdir()}
    assert {name: (f["rank"], f["message"]) for name, f in saved.items()} == {
        "rank0.json": (0, "RuntimeError: shapes differ"),
        "rank1.json": (1, "data.latent_height=3 must be even"),
        "rank2.json": (2, "ValueError: the cause"),
    }
    assert all(isinstance(f["time"], float) for f in saved.values())


def launcher_saw(tmp_path, rank: int, message: str, timestamp: int) -> ProcessFailure:
    """The launcher's record of a worker that wrote an error file (as torch's @record does)."""
    error_file = tmp_path / f"error{rank}.json"
    error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": {"timestamp": str(timestamp)}}}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=1, error_file=str(error_file))


def test_the_root_cause_is_the_earliest_real_error_not_a_broken_connection(tmp_path):
    record_failure(tmp_path, 0, ConnectionError("Connection reset by peer"))  # a survivor: a symptom
    record_failure(tmp_path, 2, RuntimeError("a later, unrelated error"))
    error = ChildFailedError("train", {1: launcher_saw(tmp_path, 1, "ValueError: bad shape\nTraceback ...", 100)})
    assert root_cause(error, tmp_path) == (1, "ValueError: bad shape")
    assert not (tmp_path / FAILURES).exists()  # read once: a later run's failures start clean


def test_a_killed_worker_without_an_error_file_is_the_cause_beside_survivors_broken_connections(tmp_path):
    record_failure(tmp_path, 0, RuntimeError("NCCL communicator was aborted on rank 0"))
    killed = ProcessFailure(local_rank=1, pid=4242, exitcode=-9, error_file=str(tmp_path / "none.json"))
    cause = root_cause(ChildFailedError("train", {1: killed}), tmp_path)
    assert cause == (1, "Signal 9 (SIGKILL) received by PID 4242")


def test_an_out_of_memory_is_one_report_with_the_planners_view_and_what_to_try(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    error = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nsee the allocator's documentation")
    lines = oom_report(error, "placement  fits\ngpu        no").splitlines()
    assert lines[0] == "CUDA out of memory on rank 3: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert lines[-4:-1] == ["planner's estimates for this teacher and hardware:", "placement  fits", "gpu        no"]
    assert lines[-1].startswith("try: a placement the planner marks as fitting (teacher_placement=auto)")
    assert "planner's estimates" not in oom_report(error, None)
