"""Tests wandistiller/job/rundir.py, through `train.run` and real lock holders in subprocesses: one live run per
run folder; the lock goes away with its process, however it ends."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT, refused
from wandistiller.core.errors import RunDirTaken, UserError
from wandistiller.job.rundir import claim_run_dir, removed_if_refused
from wandistiller.train import run

HOLD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from wandistiller.job.rundir import claim_run_dir
    claim_run_dir(Path(sys.argv[1]), None)
    print("holding", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def holder(tmp_path):
    """Another process that has claimed tmp_path/r and is still alive."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "r")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.readline().strip() == "holding"
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_run_into_a_live_runs_folder_is_refused_in_one_line(make_cfg, tmp_path, holder):
    with pytest.raises(RunDirTaken, match=rf"is in use by a live run \(pid {holder.pid} on .*hydra.run.dir") as e:
        run(make_cfg("trainer.max_steps=2", "trainer.resume=auto", run_dir=tmp_path / "r"))
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [".lock"]  # nothing of ours was written


def test_a_run_folder_on_a_file_system_without_locks_trains_unguarded_and_says_so(
    make_cfg, tmp_path, monkeypatch, caplog
):
    from tests.core.test_atomic import no_locks

    no_locks(monkeypatch)
    run(make_cfg("trainer.max_steps=1", run_dir=tmp_path / "r"))
    assert (tmp_path / "r" / "student").is_dir()
    assert f"the run folder {tmp_path / 'r'} cannot be locked" in caplog.text
    no_locks(monkeypatch, errno.EIO)  # its owner cannot be checked: not ours (a sweep records nothing there)
    with pytest.raises(RunDirTaken, match=r"cannot be locked \(Input/output error\); choose another folder"):
        claim_run_dir(tmp_path / "other", None)


def test_the_lock_is_released_when_its_holder_is_killed(tmp_path, holder):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert claim_run_dir(tmp_path / "r", None) is None


def test_another_runs_outputs_are_refused_with_rundirtaken(make_cfg, tmp_path):
    run_dir = tmp_path / "r"
    run(make_cfg("trainer.max_steps=1", run_dir=run_dir))
    with pytest.raises(RunDirTaken, match="already holds another run's outputs"):
        claim_run_dir(run_dir, None)


@pytest.mark.parametrize("resume", [None, "auto"])
@pytest.mark.parametrize("marker", ["model_index.json", "config.json", "student.workflow.json"])
def test_a_folder_holding_an_exported_model_is_never_trained_into_fresh_or_resumed(tmp_path, marker, resume):
    """An `export` or `pipeline` output (issue 41's audit: `trainer.resume=auto` into one trained into it)."""
    folder = tmp_path / "exported"
    folder.mkdir()
    (folder / marker).write_text("{}")
    with pytest.raises(RunDirTaken, match=rf"^the folder .* holds an exported model \({marker}\), not a run; choose"):
        claim_run_dir(folder, resume)
    assert sorted(p.name for p in folder.iterdir()) == [marker] and (folder / marker).read_text() == "{}"


def test_a_resume_into_an_exported_model_is_one_line_and_leaves_the_folder_as_it_was(tmp_path, cache_dir):
    from tests.conftest import run_cli

    folder = tmp_path / "pipeline"
    folder.mkdir()
    (folder / "model_index.json").write_text("{}")
    result = run_cli(f"hydra.run.dir={folder}", f"paths.cache_dir={cache_dir}", "logger=none", "trainer.resume=auto")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: the folder {folder} holds an exported model (model_index.json), not a run; choose a new folder "
        "with hydra.run.dir=…"
    ]
    assert [p.name for p in folder.iterdir()] == ["model_index.json"]  # not even Hydra's empty train.log


def test_a_refused_folder_is_not_created(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.json").write_text("{}")
    with pytest.raises(RunDirTaken):
        claim_run_dir(tmp_path / "r", None)
    assert not (tmp_path / "r" / ".lock").exists()


@pytest.mark.parametrize("inside", ["student", "checkpoints/new", "pipeline/transformer"])
@pytest.mark.parametrize("resume", [None, "auto"])
def test_a_run_inside_another_runs_folder_is_refused_before_anything_is_written(tmp_path, inside, resume):
    """Issue 41: `hydra.run.dir=<run>/student` trained a new run into an earlier run's student folder."""
    earlier = tmp_path / "earlier"
    (earlier / ".hydra").mkdir(parents=True)
    (earlier / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (earlier / inside).mkdir(parents=True)
    with pytest.raises(RunDirTaken, match=rf"^the run folder {earlier / inside} lies inside the run folder {earlier},"):
        claim_run_dir(earlier / inside, resume)
    assert sorted(p.name for p in (earlier / inside).iterdir()) == []


def test_a_refusal_at_setup_removes_the_loggers_folders_it_made_too(tmp_path):
    """Issue 41: hooks.evaluate.per_prompt=1000000, refused when the hook is bound (after the tracker started),
    left .hydra, .lock, pruning.json, train.log and wandb/ behind."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "train.log").write_text("")  # what Hydra made before the job
    with pytest.raises(UserError), removed_if_refused(run_dir):
        for name in (".hydra", "wandb/offline-run-1", "tensorboard"):
            (run_dir / name).mkdir(parents=True)
        (run_dir / "pruning.json").write_text("{}")
        raise UserError("refused at setup")
    assert not run_dir.exists()


def test_a_folder_holding_other_runs_is_refused_as_a_run_folder(make_cfg, tmp_path):
    # An audit's hydra.run.dir=outputs: the run's student/ and checkpoints/ among the runs' folders there.
    outputs = tmp_path / "outputs"
    (outputs / "2026-11-30" / "10-00-00" / ".hydra").mkdir(parents=True)
    (outputs / "2026-11-30" / "10-00-00" / ".hydra" / "config.yaml").write_text("seed: 0\n")
    with refused(f"the folder {outputs} holds the run folder {outputs / '2026-11-30' / '10-00-00'}, and a run's"):
        run(make_cfg(run_dir=outputs))
    assert sorted(p.name for p in outputs.iterdir()) == ["2026-11-30"]
    with refused(f"paths.cache_dir: it is or lies in the run folder {outputs / '2026-11-30' / '10-00-00'}, whose"):
        run(make_cfg(f"paths.cache_dir={outputs / '2026-11-30' / '10-00-00' / 'cache'}", run_dir=tmp_path / "r"))
    own = tmp_path / "own"  # its own folder's cache (paths.cache_dir=${hydra:runtime.output_dir}/cache): its own
    cache = (f"paths.cache_dir={own / 'cache'}", "trainer.checkpoint_every=1")
    run(make_cfg("trainer.max_steps=1", *cache, run_dir=own))
    assert run(make_cfg("trainer.max_steps=2", "trainer.resume=auto", *cache, run_dir=own))["final_step"] == 2


def test_a_run_folder_refused_inside_another_run_leaves_no_empty_log_in_that_run(tmp_path, monkeypatch):
    from wandistiller.job import rundir

    earlier = tmp_path / "earlier"
    (earlier / ".hydra").mkdir(parents=True)
    (earlier / ".hydra" / "config.yaml").write_text("seed: 0\n")
    monkeypatch.setattr(rundir, "MISSING_BEFORE", set())
    rundir.note_missing_run_dir([f"hydra.run.dir={earlier / 'sub'}"])
    (earlier / "sub").mkdir()
    (earlier / "sub" / "train.log").write_text("")  # what Hydra makes before the job
    with pytest.raises(RunDirTaken, match="lies inside the run folder"), removed_if_refused(earlier / "sub"):
        claim_run_dir(earlier / "sub", None)
    assert sorted(p.name for p in earlier.iterdir()) == [".hydra"]
    (earlier / "own").mkdir()  # a folder that was there before this command: never removed
    (earlier / "own" / "train.log").write_text("")
    with pytest.raises(RunDirTaken), removed_if_refused(earlier / "own"):
        claim_run_dir(earlier / "own", None)
    assert (earlier / "own" / "train.log").is_file()


def test_a_sweep_point_refused_for_its_folder_writes_nothing_there(make_cfg, tmp_path):
    from wandistiller.tracking.sweep import record_failed_point

    run_dir = tmp_path / "r"
    (run_dir / "checkpoints").mkdir(parents=True)  # a live run's, say: no metrics.json yet
    point = {"choices": {"teacher_placement": "cpu"}, "overrides": ["trainer.batch_size=2"]}
    record = record_failed_point(make_cfg(run_dir=run_dir), RunDirTaken("in use"), point)
    assert record["status"] == "refused" and sorted(p.name for p in run_dir.iterdir()) == ["checkpoints"]


def test_runs_started_in_the_same_second_get_their_own_default_folders(tmp_path):
    """The default folder is named by the second; mkdir decides who gets which name, even in a race."""
    from concurrent.futures import ThreadPoolExecutor

    from wandistiller.job.rundir import unique_folder

    folder = tmp_path / "outputs" / "2026-11-26" / "11-10-00"
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: unique_folder(folder), range(8)))
    assert len(set(got)) == 8 and folder in got and folder.with_name("11-10-00_7") in got


def test_two_resumes_in_the_same_second_keep_both_configs(tmp_path):
    from omegaconf import OmegaConf

    from wandistiller.job.rundir import save_config

    for seed in (0, 1, 2):
        save_config(tmp_path, OmegaConf.create({"seed": seed}), None)
    saved = sorted((tmp_path / ".hydra").glob("config*.yaml"))
    assert sorted(OmegaConf.load(p).seed for p in saved) == [0, 1, 2]


def test_a_run_refused_after_its_folder_was_claimed_leaves_no_folder_in_process_too(make_cfg, tmp_path):
    with refused("trainer.resume='/no/such/ckpt'"):
        run(make_cfg("trainer.resume=/no/such/ckpt", run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_a_refusal_removes_the_date_folder_hydra_made_for_it_only_when_left_empty(tmp_path):
    def refused_in(run_dir: Path) -> None:
        run_dir.mkdir(parents=True)
        (run_dir / "train.log").write_text("")  # what Hydra writes before the job starts
        with pytest.raises(UserError), removed_if_refused(run_dir):
            raise UserError("refused")

    refused_in(tmp_path / "outputs" / "2026-11-26" / "12-00-00")
    assert not (tmp_path / "outputs").exists()  # a first run's outputs/ too: nothing of it is left
    (tmp_path / "outputs" / "2026-11-26" / "11-00-00").mkdir(parents=True)  # an earlier run's folder
    refused_in(tmp_path / "outputs" / "2026-11-26" / "12-00-00")
    assert [p.name for p in (tmp_path / "outputs" / "2026-11-26").iterdir()] == ["11-00-00"]
    refused_in(tmp_path / "mine" / "run")  # hydra.run.dir=mine/run: mine/ is the user's own folder
    assert (tmp_path / "mine").is_dir() and not (tmp_path / "mine" / "run").exists()


def test_resume_auto_into_a_folder_that_did_not_exist_is_told_apart_from_an_empty_one(tmp_path, monkeypatch, caplog):
    import logging

    from wandistiller.job import rundir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(rundir, "MISSING_BEFORE", set())
    (tmp_path / "empty").mkdir()  # a preempted job's first launch: the folder is there, with no checkpoint
    rundir.note_missing_run_dir(["trainer.resume=auto", "hydra.run.dir=typo", "hydra.run.dir=empty"])
    (tmp_path / "typo").mkdir()  # as Hydra makes it before the job starts
    with caplog.at_level(logging.INFO):
        for name in ("empty", "typo", "new_in_process"):
            assert rundir.claim_run_dir(tmp_path / name, "auto") is None
            rundir.release_run_dir(tmp_path / name)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [m.split(" yet, so a new one")[0] for m in warned] == [
        f"trainer.resume=auto: no run in {tmp_path / n}" for n in ("typo", "new_in_process")
    ]


# -- resume=auto on a received killed run: nothing outside its folder written, pruned or read -------------------
def killed_copy(finished, tmp_path) -> Path:
    """A copy of a finished run as a killed one looks (no student/ and metrics.json yet), from someone else."""
    import shutil

    folder = tmp_path / "received"
    shutil.copytree(finished, folder)
    shutil.rmtree(folder / "student")
    (folder / "metrics.json").unlink()
    return folder


@pytest.mark.parametrize("name", ["checkpoints", "metrics_steps.jsonl", "train.log", ".lock", ".hydra", "tensorboard",
                                  ".failures", "hardlink:metrics_steps.jsonl", "hardlink:.lock"])  # fmt: skip
def test_resume_auto_into_a_received_run_refuses_a_link_out_of_it_and_writes_nothing_there(
    finished, tmp_path, make_cfg, name
):
    import shutil

    from tests.core.test_files import untouched, victim

    folder, mine = killed_copy(finished, tmp_path), victim(tmp_path)
    other = tmp_path / "other_run"
    shutil.copytree(finished, other)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in other.rglob("*") if p.is_file()}
    hard = name.startswith("hardlink:")
    name = name.removeprefix("hardlink:")
    target = other / name if name in ("checkpoints", ".hydra") else mine
    if (folder / name).is_dir():
        shutil.rmtree(folder / name)
    (folder / name).unlink(missing_ok=True)
    (folder / name).hardlink_to(target) if hard else (folder / name).symlink_to(target)
    with pytest.raises(UserError, match="leads out of the run folder|is a hard link") as e:
        run(make_cfg("trainer.max_steps=3", "trainer.resume=auto", run_dir=folder))
    assert "\n" not in str(e.value) and name in str(e.value)
    assert untouched(mine) and sorted(p.name for p in mine.parent.iterdir()) == ["victim.txt"]
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in other.rglob("*") if p.is_file()} == before


def test_a_received_killed_run_resumes_and_its_linked_outputs_are_replaced_never_written_through(
    finished, tmp_path, make_cfg
):
    from tests.core.test_files import untouched, victim

    folder, mine = killed_copy(finished, tmp_path), victim(tmp_path)
    (folder / "student").symlink_to(mine.parent)
    import shutil

    shutil.rmtree(folder / "pipeline")
    (folder / "pipeline").symlink_to(mine.parent)
    (folder / "loss.png").unlink()
    (folder / "loss.png").symlink_to(mine)
    (folder / "metrics.json").symlink_to(mine)
    summary = run(make_cfg("trainer.max_steps=3", "trainer.resume=auto", run_dir=folder))
    assert summary["final_step"] == 3 and untouched(mine)
    assert sorted(p.name for p in mine.parent.iterdir()) == ["victim.txt"]
    for name in ("student", "pipeline", "loss.png", "metrics.json"):
        assert not (folder / name).is_symlink() and (folder / name).exists()
    assert not [p for p in folder.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_resume_against_a_teacher_the_checkpoint_did_not_record_is_refused_unless_asked(finished, tmp_path, make_cfg):
    import yaml

    from tests.evaluation.test_evaluate import POCKET

    folder = killed_copy(finished, tmp_path)
    saved = yaml.safe_load((folder / ".hydra" / "config.yaml").read_text())
    saved["teacher"] |= {"path": str(POCKET), "builtin": None, "name": POCKET.name}  # the sender edited teacher.path
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(saved))
    teacher = (f"teacher.path={POCKET}", "teacher.builtin=null")  # as saved: only the checkpoint's record differs
    with pytest.raises(UserError, match=r"does not fit this teacher: .*add trainer.allow_other_teacher=true") as e:
        run(make_cfg("trainer.max_steps=3", "trainer.resume=auto", *teacher, run_dir=folder))
    assert "\n" not in str(e.value) and "num_attention_heads" in str(e.value)
    from wandistiller.job.resumed import continued_config

    saved["trainer"]["allow_other_teacher"] = True  # a saved config never allows it on its own
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(saved))
    cfg = continued_config(make_cfg("trainer.resume=auto", run_dir=folder), ["trainer.resume=auto"])
    assert cfg.trainer.allow_other_teacher is False
    cfg = continued_config(make_cfg("trainer.resume=auto", "trainer.allow_other_teacher=true", run_dir=folder),
                           ["trainer.resume=auto", "trainer.allow_other_teacher=true"])  # fmt: skip
    assert cfg.trainer.allow_other_teacher is True


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_finished_run_without_checkpoints_is_never_trained_over_by_a_resume(make_cfg, tmp_path):
    """A finished run whose checkpoints were deleted (to save disk): `trainer.resume=auto` has nothing to continue
    from, and would have trained from step 0 over its student (an audit's find); refused in one line that names the
    way on from its student, and the folder left byte for byte."""
    run_dir = tmp_path / "r"
    run(make_cfg("trainer.max_steps=1", run_dir=run_dir))
    shutil.rmtree(run_dir / "checkpoints")
    before = tree(run_dir)
    for resume in ([], ["trainer.resume=auto"]):
        with pytest.raises(RunDirTaken, match=r"holds a finished run's outputs \(metrics.json and student\) and no "
                           rf"checkpoint to continue it from; .* student.init={run_dir}/student") as e:  # fmt: skip
            run(make_cfg("trainer.max_steps=2", *resume, run_dir=run_dir))
        assert "\n" not in str(e.value) and "trainer.resume=auto to" not in str(e.value)
        assert tree(run_dir) == before


def test_a_resume_whose_checkpoints_are_all_damaged_is_one_line_and_writes_nothing_into_the_run(make_cfg, tmp_path):
    """Refused before the folder is claimed: the line names the newest checkpoint's damage (no "see above"), and
    the run's train.log and lock are as they were."""
    run_dir = tmp_path / "r"
    run(make_cfg("trainer.max_steps=2", run_dir=run_dir))
    for tensors in (run_dir / "checkpoints").glob("step_*/tensors.safetensors"):
        tensors.write_bytes(tensors.read_bytes()[:1000])
    (run_dir / "train.log").write_text("the first run's log\n")
    before = tree(run_dir)
    with pytest.raises(UserError, match=r"none of the checkpoints in .* can be resumed from \(the newest: step_0+2: "
                       r".*is truncated .*\); move them away") as e:  # fmt: skip
        run(make_cfg("trainer.max_steps=3", "trainer.resume=auto", run_dir=run_dir))
    assert "see above" not in str(e.value) and tree(run_dir) == before


def test_a_lora_resume_under_a_teacher_with_other_experts_is_refused_even_when_allowed(
    make_cfg, tmp_path, tiny_moe_path
):
    """trainer.allow_other_teacher takes another teacher on purpose; a LoRA student's checkpoint holds one adapter
    set per expert, so under a teacher with another count of experts it cannot load. Refused in the preflight, in
    one line naming the experts (it once said "another student shape ... resume with the student config", and left
    a resume config naming the new teacher, which later evals then followed)."""
    folder = tmp_path / "r"
    run(make_cfg("student=lora", "trainer.max_steps=1", run_dir=folder))
    before = tree(folder)
    with pytest.raises(UserError) as e:
        other = (f"teacher.path={tiny_moe_path}", "trainer.allow_other_teacher=true")
        run(make_cfg("student=lora", *other, "trainer.max_steps=2", "trainer.resume=auto", run_dir=folder))
    assert "holds adapters for 1 expert(s)" in str(e.value) and "has 2; resume under the teacher it was" in str(e.value)
    assert "\n" not in str(e.value) and tree(folder) == before
    # Nor a teacher of another shape: its layers are not the ones the adapters were made for (it said "another
    # student shape ... resume with the student config", after encoding the data).
    from wandistiller.core.arch import TINY_TRANSFORMER
    from wandistiller.teacher.tiny import build_tiny_pipeline

    fewer = tmp_path / "fewer"
    build_tiny_pipeline(transformer_config={"num_layers": TINY_TRANSFORMER["num_layers"] - 1}).save_pretrained(fewer)
    with pytest.raises(UserError) as e:
        other = (f"teacher.path={fewer}", "trainer.allow_other_teacher=true")
        run(make_cfg("student=lora", *other, "trainer.max_steps=2", "trainer.resume=auto", run_dir=folder))
    assert "its adapters were trained on a teacher with num_layers=" in str(e.value), e.value
    assert "allow_other_teacher" not in str(e.value) and tree(folder) == before


def test_a_resume_refused_at_setup_leaves_no_resume_config_behind(make_cfg, tmp_path, monkeypatch):
    """A refusal only the loaded checkpoint can give (restore's) comes after the resume's config is saved: it goes
    again, so the run's newest config is still the one that trained it (eval and generate follow that one)."""
    from wandistiller.state import checkpoint

    folder = tmp_path / "r"
    run(make_cfg("trainer.max_steps=1", run_dir=folder))
    hydra = sorted(p.name for p in (folder / ".hydra").iterdir())

    def refused(*args, **kwargs):
        raise UserError("trainer.resume: this checkpoint does not load here")

    monkeypatch.setattr(checkpoint, "check_compatible", refused)
    with pytest.raises(UserError, match="does not load here"):
        run(make_cfg("trainer.max_steps=2", "trainer.resume=auto", run_dir=folder))
    assert sorted(p.name for p in (folder / ".hydra").iterdir()) == hydra


def test_a_sweep_into_a_run_or_an_earlier_sweep_is_refused_unless_it_continues_it(tmp_path):
    # An audit's: a sweep into a finished run wrote its report and points into it; one into an earlier sweep
    # reported the old sweep's numbers as its own and exited 0.
    from wandistiller.job.rundir import check_sweep_folder

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("seed: 0\n")
    for folder in (run, run / "sweep"):
        with pytest.raises(UserError, match=f"hydra.sweep.dir={folder} is or lies in the run folder {run}; choose"):
            check_sweep_folder(folder, ["precision=fp32,bf16"])
    sweep = tmp_path / "sweep"
    (sweep / "0" / ".hydra").mkdir(parents=True)
    (sweep / "0" / ".hydra" / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(UserError, match="holds an earlier sweep; add trainer.resume=auto to continue its points"):
        check_sweep_folder(sweep, ["precision=fp32,bf16"])
    check_sweep_folder(sweep, ["precision=fp32,bf16", "trainer.resume=auto"])
    check_sweep_folder(tmp_path / "new", ["precision=fp32,bf16"])
    (tmp_path / "empty").mkdir()
    check_sweep_folder(tmp_path / "empty", ["precision=fp32,bf16"])
