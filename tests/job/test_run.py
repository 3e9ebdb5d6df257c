"""wandistiller/job/run.py: `run(cfg, register)`, one job as a plain function: it never overwrites another run's
outputs, a finished run's resume is nothing to do (whatever its metrics.json), what preflight built is handed down,
and the workers it launches register the options before they read a run."""

from __future__ import annotations

import hashlib
import logging
import shutil

import pytest
import torch

from wandistiller.compose import register_configs
from wandistiller.core.errors import UserError
from wandistiller.job import run as job
from wandistiller.teacher.spec import inspect_teacher


def run(cfg) -> dict:
    return job.run(cfg, register_configs)


def digest(folder):
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_folder_with_another_runs_outputs_is_never_overwritten(make_cfg, tmp_path):
    run_dir = tmp_path / "r"
    run(make_cfg("trainer.max_steps=2", run_dir=run_dir))
    before = digest(run_dir)
    with pytest.raises(UserError, match="already holds another run's outputs.*trainer.resume=auto"):
        run(make_cfg("trainer.max_steps=4", run_dir=run_dir))
    # Its own checkpoint named by path: said first, not after checks against this command line's config (whose
    # default teacher's line offered trainer.allow_other_teacher, which then met the claim's refusal).
    own = f"trainer.resume={run_dir}/checkpoints/step_00000002"
    with pytest.raises(UserError, match="already holds checkpoints .up to step_00000002., and a checkpoint named by"):
        run(make_cfg("trainer.max_steps=4", own, "teacher=tiny_moe", run_dir=run_dir))
    assert digest(run_dir) == before


def test_resuming_a_finished_run_with_a_damaged_metrics_json_is_nothing_to_do(finished, make_cfg, tmp_path, caplog):
    """Issue 41: `trainer.resume=auto` at the run's own trainer.max_steps read metrics.json to say "nothing to do",
    and a damaged one was an internal error; now a warning, and the run's outputs as they were."""
    run_dir = tmp_path / "r"
    shutil.copytree(finished, run_dir)
    (run_dir / "metrics.json").write_text('{"bad')
    before = digest(run_dir)
    with caplog.at_level(logging.WARNING, logger="wandistiller"):
        assert run(make_cfg("trainer.max_steps=2", "trainer.resume=auto", run_dir=run_dir)) == {}
    assert "metrics.json is damaged" in caplog.text and "nothing was trained" in caplog.text
    kept = lambda files: {k: v for k, v in files.items() if "log" not in k and "config_resume" not in k}
    assert kept(digest(run_dir)) == kept(before)  # what a resume records of itself aside, the run as it was


def test_resuming_a_finished_run_whose_student_is_gone_writes_it_again(finished, make_cfg, tmp_path):
    """export's line for a run without student/ says "finish it (trainer.resume=auto)": at trainer.max_steps that
    was "nothing to do", and no student/ came back; now its checkpoint at max_steps writes the final outputs."""
    from safetensors.torch import load_file

    run_dir = tmp_path / "r"
    shutil.copytree(finished, run_dir)
    weights = {p.name: load_file(p) for p in (run_dir / "student").glob("*.safetensors")}
    shutil.rmtree(run_dir / "student")
    run(make_cfg("trainer.max_steps=2", "trainer.resume=auto", run_dir=run_dir))
    again = {p.name: load_file(p) for p in (run_dir / "student").glob("*.safetensors")}
    assert again.keys() == weights.keys() and all(
        torch.equal(again[f][k], t) for f, tensors in weights.items() for k, t in tensors.items()
    )


def test_one_run_builds_the_method_and_reads_the_teacher_and_student_once(make_cfg, tmp_path, monkeypatch):
    """preflight builds and reads them once and hands them down (`Prepared`): the checks, the planner's call, the
    recipe's setup and the end-of-run evaluation use its results."""
    import collections
    import sys

    from wandistiller.placements.planner import planning_teacher_config
    from wandistiller.recipe.methods import Method
    from wandistiller.student.model import check_student

    calls: collections.Counter = collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(Method, "__init__", counted("Method", Method.__init__))  # every method's __init__ calls it
    for fn in (inspect_teacher, check_student, planning_teacher_config):
        for module in [m for name, m in sys.modules.items() if name.startswith("wandistiller")]:
            if getattr(module, fn.__name__, None) is fn:  # the name each module calls it by
                monkeypatch.setattr(module, fn.__name__, counted(fn.__name__, fn))
    evaluated = ("hooks=[monitor,progress,evaluate]", "hooks.evaluate.limit=1", "hooks.evaluate.steps=2")
    run(make_cfg("trainer.max_steps=1", *evaluated, run_dir=tmp_path / "r"))
    assert (tmp_path / "r" / "eval.json").is_file()
    assert calls == {"Method": 1, "inspect_teacher": 1, "check_student": 1, "planning_teacher_config": 1}


@pytest.mark.slow  # two ranks in launched worker processes, and the end-of-run evaluation
def test_launched_workers_register_the_options_before_the_end_of_run_evaluation_reads_the_run(make_cfg, tmp_path):
    """A worker process imports job/run.py alone (not the CLI that registered the options on import): called in
    process, with two ranks, the evaluation at the end (which vets the run's saved `_target_`s against the
    registries) still runs and writes eval.json."""
    evaluated = ("hooks=[monitor,progress,evaluate]", "hooks.evaluate.limit=1", "hooks.evaluate.steps=2")
    summary = run(make_cfg("trainer.max_steps=1", "distributed.nproc_per_node=2", *evaluated, run_dir=tmp_path / "r"))
    assert summary["status"] == "completed" and (tmp_path / "r" / "eval.json").is_file()
