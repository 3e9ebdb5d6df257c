"""wandistiller/recipe/methods/dmd.py: the K-step student trained by distribution matching under a local teacher,
with its online fake score and the optional regression term; a resume repeats an uninterrupted run bit for bit
(student, fake score and its optimizer); a dedicated teacher owner, sent the student's inputs, gives the same loss
curve as a teacher here; two training ranks train it (node owner + served rank, DDP over gloo); a LoRA fake score
starts as the teacher, trains its adapters alone (the teacher bit for bit as loaded; DDP over gloo averages their
gradients) and resumes bit for bit; what it cannot do is refused in one line (the CLI: exit 2)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import (
    FP32,
    ROOT,
    background_job,
    cli,
    job_result,
    metrics_steps,
    refused,
    run_cli,
    session_env,
    unavailable_compile,
)
from wandistiller.core.distributed import Topology
from wandistiller.core.errors import UserError
from wandistiller.placements.balanced import BalancedPlacement
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.placements.disk import DiskPlacement
from wandistiller.placements.gpu0 import Gpu0Placement
from wandistiller.recipe.methods.dmd import DMD, OPTION, LoraFakeScore
from wandistiller.state.checkpoint import load_checkpoint
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.train import run

FAST = ["method=dmd", "method.steps=2", "method.fake_updates=2", "trainer.batch_size=2", "trainer.log_every=1"]
# make_cfg's defaults, spelt out for the runs in fresh processes (a served teacher, two training ranks).
CLI = ["logger=none", "trainer.progress_bar=false", "hooks=[monitor,progress]", "hooks.monitor.val_every=0",
       "precision=fp32", "trainer.max_steps=3", *FAST]  # fmt: skip
SERVED = {
    "dmd_dedicated": ["teacher_placement=gpu0", "teacher_placement.debug_cpu=true", "distributed.nproc_per_node=2"],
    "dmd_two_students": ["teacher_placement=cpu", "distributed.nproc_per_node=2", "trainer.grad_accum_steps=2"],
}


def _start(name: str):
    def start(request, submit):
        """The dmd run of `SERVED[name]` in two fresh processes over gloo, started with the session."""
        cache_dir, factory = request.getfixturevalue("cache_dir"), request.getfixturevalue("tmp_path_factory")
        request.getfixturevalue("tiny_path")
        run_dir = factory.mktemp(name) / "r"
        args = cli(f"hydra.run.dir={run_dir}", f"paths.cache_dir={cache_dir}", *CLI, *SERVED[name])
        env = session_env(request)
        return submit(lambda: (subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env,
                                          timeout=600), run_dir))  # fmt: skip

    return start


for _name in SERVED:
    background_job(_name)(_start(_name))


@pytest.fixture
def dmd_dedicated(session_jobs):
    return job_result(session_jobs, "dmd_dedicated")


@pytest.fixture
def dmd_two_students(session_jobs):
    return job_result(session_jobs, "dmd_two_students")


def _roles(run_dir) -> list[str]:
    return [r["role"] for r in json.loads((run_dir / "metrics.json").read_text())["ranks"]]


@pytest.mark.slow  # two runs, one in two fresh processes (~50 s on 2 cores)
def test_a_dedicated_owner_sent_the_students_inputs_trains_dmd_as_a_teacher_here(make_cfg, tmp_path, dmd_dedicated):
    here = tmp_path / "r"
    run(make_cfg(*FAST, "trainer.max_steps=3", "teacher_placement=cpu", run_dir=here))
    result, served = dmd_dedicated
    assert result.returncode == 0, result.stderr[-3000:]
    assert _roles(served) == ["teacher owner", "student"]
    rows, served_rows = metrics_steps(here), metrics_steps(served)
    assert len(rows) == len(served_rows) == 3
    for key in ("loss", "loss_dmd", "loss_fake_score", "grad_norm"):
        assert torch.allclose(torch.tensor([r[key] for r in rows]), torch.tensor([r[key] for r in served_rows]),
                              rtol=1e-4, atol=1e-6), key  # fmt: skip


@pytest.mark.slow  # a run in two fresh processes
def test_two_training_ranks_train_dmd_one_of_them_served_by_the_other(dmd_two_students):
    result, run_dir = dmd_two_students
    assert result.returncode == 0, result.stderr[-3000:]
    assert _roles(run_dir) == ["owner + student", "student"]
    rows = metrics_steps(run_dir)
    assert len(rows) == 3
    assert all(math.isfinite(r[k]) and r[k] > 0 for r in rows for k in ("loss_dmd", "loss_fake_score", "teacher_ms"))
    saved = load_checkpoint(run_dir / "checkpoints" / "step_00000003")
    assert set(saved["method"]) == {"fake_score"}


def test_dmd_trains_the_student_and_its_fake_score_with_the_regression_term(make_cfg, tmp_path):
    folder = tmp_path / "r"
    extra = ["method.regression_weight=0.5", "method.teacher_steps=4", "method.noises_per_prompt=1"]
    summary = run(make_cfg(*FAST, *extra, "trainer.max_steps=3", run_dir=folder))
    assert summary["status"] == "completed"
    for r in metrics_steps(folder):
        assert r["loss_dmd"] > 0 and r["loss_regression"] > 0 and r["loss_fake_score"] > 0
        assert r["loss"] == pytest.approx(r["loss_dmd"] + 0.5 * r["loss_regression"], rel=1e-5)
        assert r["teacher_ms"] > 0  # the teacher's score at the student's samples
    saved = load_checkpoint(folder / "checkpoints" / "step_00000003")
    assert set(saved["method"]) == {"fake_score"} and set(saved["method"]["fake_score"]) == {
        "module", "optimizer", "scaler"}  # fmt: skip


@pytest.mark.parametrize(  # lora and an older checkpoint in the slow lane: the default lane keeps its 4 minutes
    "fake_score,recorded",
    [("student", True), pytest.param("lora", True, marks=pytest.mark.slow),
     pytest.param("student", False, marks=pytest.mark.slow)],
    ids=["student", "lora", "older"],
)  # fmt: skip
def test_a_resumed_dmd_run_equals_an_uninterrupted_one_bit_for_bit(make_cfg, tmp_path, fake_score, recorded):
    """`older`: a checkpoint of before the method was recorded in it resumes as it did."""
    common = [*FAST, f"method.fake_score={fake_score}", "trainer.max_steps=4", "trainer.checkpoint_every=2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(make_cfg(*common, run_dir=straight))
    run(make_cfg(*common, "trainer.max_steps=2", "trainer.schedule_steps=4", run_dir=resumed))  # cut at 2 of 4
    for leftover in ("student", "metrics.json"):
        shutil.rmtree(resumed / leftover) if (resumed / leftover).is_dir() else (resumed / leftover).unlink()
    if not recorded:
        _forget_the_method(resumed / "checkpoints" / "step_00000002")
    with (resumed / "metrics_steps.jsonl").open("a") as f:  # what a segment killed after step 2 left: redone
        f.write('{"step": 3, "loss": 9.0, "loss_dmd": 9.0, "loss_fake_score": 9.0, "grad_norm": 9.0}\n{"step": 4, "lo')
    run(make_cfg(*common, "trainer.resume=auto", run_dir=resumed))
    keys = ("loss", "loss_dmd", "loss_fake_score", "grad_norm")
    assert [[r[k] for k in keys] for r in metrics_steps(resumed)] == [[r[k] for k in keys] for r in
                                                                      metrics_steps(straight)]  # fmt: skip
    a = load_checkpoint(straight / "checkpoints/step_00000004")
    b = load_checkpoint(resumed / "checkpoints/step_00000004")
    for key, value in a["student"].items():
        assert torch.equal(value, b["student"][key]), key
    fake_a, fake_b = a["method"]["fake_score"], b["method"]["fake_score"]
    for key, value in fake_a["module"].items():
        assert torch.equal(value, fake_b["module"][key]), key
    state_a, state_b = fake_a["optimizer"]["state"], fake_b["optimizer"]["state"]
    assert all(torch.equal(state_a[i]["exp_avg"], state_b[i]["exp_avg"]) for i in state_a)


def _forget_the_method(step) -> None:
    """The checkpoint as one written before checkpoints recorded their method."""
    state = json.loads((step / "state.json").read_text())
    assert state.pop("method_identity") == {"name": "dmd", "steps": 2, "fake_score": state_fake_score(state)}
    (step / "state.json").write_text(json.dumps(state))


def state_fake_score(state: dict) -> str:
    module = state["method"]["fake_score"]["module"]
    return "lora" if all(k.startswith("adapters.") for k in module) else "student"


@pytest.fixture(scope="module")
def dmd_run(tmp_path_factory, cache_dir, tiny_path):
    """A dmd run of 2 steps (method.steps=2, the student fake score), a checkpoint at step 2: resumed below."""
    from hydra import compose, initialize_config_dir

    from tests.conftest import CONF

    folder = tmp_path_factory.mktemp("dmd_run") / "run"
    overrides = [f"paths.cache_dir={cache_dir}", f"paths.output_dir={folder}", "logger=none", "precision=fp32",
                 "trainer.progress_bar=false", "hooks=[monitor,progress]", "hooks.monitor.val_every=0",
                 *FAST, "trainer.max_steps=2", "trainer.checkpoint_every=2"]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        run(compose("train", overrides=overrides))
    return folder


def _listing(folder) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


OTHER_METHODS = {  # another method, or dmd with another K or fake score: what this run says of itself
    "lora": ([*FAST, "method.fake_score=lora"], "this run sets method.fake_score=lora, method.lora_rank=16"),
    "teacher": ([*FAST, "method.fake_score=teacher"], "this run sets method.fake_score=teacher"),
    "steps": (["method=dmd", "method.steps=1", "trainer.batch_size=2"], "this run sets method.steps=1"),
    "trajectory": (["method=trajectory", "method.steps=2"], "this run's is method=trajectory"),
    "kd": ([], "this run's is method=kd"),
}


@pytest.mark.parametrize("other", list(OTHER_METHODS))
def test_a_checkpoint_resumed_with_another_method_is_refused_in_one_line_before_anything_is_claimed(
    make_cfg, tmp_path, dmd_run, other
):
    overrides, this_run = OTHER_METHODS[other]
    step, before = dmd_run / "checkpoints" / "step_00000002", _listing(dmd_run)
    with pytest.raises(UserError) as e:
        run(make_cfg(*overrides, "trainer.max_steps=4", f"trainer.resume={step}", run_dir=tmp_path / "new"))
    assert str(e.value) == (
        f"trainer.resume={step}: the checkpoint was trained with method=dmd (method.steps=2, method.fake_score="
        f"student), and {this_run}; resume with those, or start a new run folder from its student (student.init="
        f"{dmd_run / 'student'})"
    )
    assert not (tmp_path / "new").exists() and _listing(dmd_run) == before  # nothing claimed, nothing touched


def test_an_older_checkpoint_whose_networks_do_not_fit_the_method_is_one_line(make_cfg, tmp_path, dmd_run):
    """Without the record, the networks are checked as they load: never a traceback, never dropped."""
    older = tmp_path / "older"
    shutil.copytree(dmd_run, older)
    _forget_the_method(older / "checkpoints" / "step_00000002")
    resume = [f"trainer.resume={older / 'checkpoints' / 'step_00000002'}", "trainer.max_steps=3"]
    with refused("trainer.resume: the checkpoint's fake_score does not fit method=dmd's (RuntimeError: Error(s) in "
                 "loading state_dict for LoraFakeScore); resume with the method (and method.* settings) it was "
                 "trained with, or start a new run folder"):  # fmt: skip
        run(make_cfg(*FAST, "method.fake_score=lora", *resume, run_dir=tmp_path / "lora"))
    with refused("trainer.resume: the checkpoint holds fake_score, and method=kd trains none beside the student (it "
                 "was trained with another method)"):  # fmt: skip
        run(make_cfg(*resume, run_dir=tmp_path / "kd"))


@pytest.mark.slow  # the in-process refusals above hold its lines; this adds the exit code and a clean terminal
def test_the_cli_refuses_a_checkpoint_of_another_fake_score_with_one_line_and_claims_nothing(
    tmp_path, cache_dir, dmd_run
):
    step, before = dmd_run / "checkpoints" / "step_00000002", _listing(dmd_run)
    folder = tmp_path / "new"
    result = run_cli(f"hydra.run.dir={folder}", f"paths.cache_dir={cache_dir}", *CLI, "method.fake_score=lora",
                     f"trainer.resume={step}")  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().startswith(f"error: trainer.resume={step}: the checkpoint was trained with "
                                            "method=dmd (method.steps=2, method.fake_score=student), and this run "
                                            "sets method.fake_score=lora")  # fmt: skip
    assert len(result.stderr.strip().splitlines()) == 1
    assert not folder.exists() and _listing(dmd_run) == before


@pytest.mark.slow  # a fresh process (~5 s); the line's order in-process: tests/job/test_resumed.py
def test_the_cli_refuses_a_resume_of_a_dmd_run_without_a_word_in_its_log(tmp_path, cache_dir, dmd_run):
    folder = tmp_path / "run"
    shutil.copytree(dmd_run, folder)
    (folder / "train.log").write_text("the first run's log\n")  # what Hydra wrote there (in-process runs write none)
    before = _listing(folder)
    result = run_cli(f"hydra.run.dir={folder}", f"paths.cache_dir={cache_dir}", "trainer.resume=auto",
                     "trainer.teacher_whole_step=true")  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().startswith("error: trainer.teacher_whole_step=true rebuilds a step's inputs")
    assert len(result.stderr.strip().splitlines()) == 1
    assert (folder / "train.log").read_text() == "the first run's log\n" and _listing(folder) == before


def test_a_teacher_shaped_fake_score_trains_where_the_whole_teacher_is_on_the_training_device(make_cfg, tmp_path):
    run(make_cfg(*FAST, "method.fake_score=teacher", "trainer.max_steps=1", run_dir=tmp_path / "r"))
    fake = load_checkpoint(tmp_path / "r" / "checkpoints" / "step_00000001")["method"]["fake_score"]["module"]
    assert any(k.startswith("transformer.blocks.1.") for k in fake)  # the tiny teacher's two blocks, not the student's


def _teacher(path):
    """A teacher as teacher_placement=cpu loads it (fp32), guidance 1."""
    teacher_cfg = OmegaConf.create({"guidance_scale": 1.0, "guidance_scale_2": None})
    return CpuPlacement().load(inspect_teacher(path), teacher_cfg, FP32, Topology())


def test_a_lora_fake_score_starts_as_the_teacher_and_backpropagates_to_its_adapters_alone(tiny_moe_path):
    teacher = _teacher(tiny_moe_path)
    fake = LoraFakeScore(teacher, 4, torch.float32, seed=0)
    assert list(fake.state_dict()) and all(k.startswith("adapters.") for k in fake.state_dict())  # no teacher
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(4, 16, 1, 8, 8, generator=g), torch.randn(4, 512, 32, generator=g)
    t = torch.tensor([950.0, 100.0, 880.0, 300.0])  # both experts' (the boundary: 875)
    expert = lambda i, rows: teacher.experts[i](x[rows], t[rows], cond[rows], return_dict=False)[0]
    with torch.no_grad():  # each expert alone on the samples it serves, adapters off: the teacher's own velocity
        first, second = expert(0, [0, 2]), expert(1, [1, 3])
    pred, _ = fake(x, t, cond)
    assert torch.equal(pred[[0, 2]], first) and torch.equal(pred[[1, 3]], second)  # B = 0: the teacher exactly
    pred.square().mean().backward()
    assert all(p.grad is None for expert in teacher.experts for p in expert.parameters())  # frozen, but ...
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in fake.named_parameters() if ".up." in n)
    with torch.no_grad():  # ... the gradient passed through them; trained adapters change the fake score alone
        for p in fake.parameters():
            p.add_(0.1)
        trained, _ = fake(x, t, cond)
        again = expert(0, [0, 2])
    assert not torch.allclose(trained[[0, 2]], first) and torch.equal(again, first)


def test_dmd_with_a_lora_fake_score_trains_its_adapters_and_leaves_the_teacher_bit_for_bit(
    make_cfg, tmp_path, monkeypatch
):
    seen = {}
    bind = DMD.bind

    def keeping_the_teacher(self, ctx, *args):
        bind(self, ctx, *args)
        seen["teacher"] = self.teacher
        seen["loaded"] = {k: v.clone() for k, v in self.teacher.experts[0].state_dict().items()}

    monkeypatch.setattr(DMD, "bind", keeping_the_teacher)
    folder = tmp_path / "r"
    run(make_cfg(*FAST, "method.fake_score=lora", "method.lora_rank=4", "trainer.max_steps=2", run_dir=folder))
    after = seen["teacher"].experts[0].state_dict()
    assert seen["loaded"].keys() == after.keys()
    assert all(torch.equal(value, after[key]) for key, value in seen["loaded"].items())
    assert all(r["loss_fake_score"] > 0 and r["loss_dmd"] > 0 for r in metrics_steps(folder))
    fake = load_checkpoint(folder / "checkpoints" / "step_00000002")["method"]["fake_score"]["module"]
    # The adapters alone (4 blocks x 10 Linears, A and B each), B trained away from its zeros.
    assert len(fake) == 80 and all(k.startswith("adapters.0.") for k in fake)
    assert all(v.abs().sum() > 0 for k, v in fake.items() if ".up." in k)
    assert fake["adapters.0.down.blocks_0_attn1_to_q"].shape == (4, 32)


def _lora_ddp_check(paths: dict) -> list:
    """Each rank's adapter gradients after two DDP backwards through its own two-expert teacher, as dmd wraps the fake
    score: rank 0's samples all at the first expert (the second's adapters unused there), rank 1's at both. All
    equal and none zero, the teacher's none (in conftest.two_ranks)."""
    import gc
    import time

    import torch.distributed as dist

    from wandistiller.recipe.methods.dmd import data_parallel

    teacher = _teacher(__import__("pathlib").Path(paths["moe"]))
    fake = LoraFakeScore(teacher, 2, torch.float32, seed=0)
    model = data_parallel(fake, torch.device("cpu"), dist.group.WORLD)
    g = torch.Generator().manual_seed(dist.get_rank())  # different data on each rank
    t = torch.tensor([950.0, 900.0] if dist.get_rank() == 0 else [950.0, 100.0])  # the boundary: 875
    found = []
    for _ in range(2):  # without find_unused_parameters the second would fail: the first's reduction unfinished
        fake.zero_grad(set_to_none=True)
        x, cond = torch.randn(2, 16, 1, 8, 8, generator=g), torch.randn(2, 8, 32, generator=g)
        model(x, t, cond)[0].square().mean().backward()
        grads = torch.cat([p.grad.flatten() for n, p in fake.named_parameters() if ".up." in n])
        gathered = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, grads)
        found += [bool(torch.equal(gathered[0], g)) and bool(g.abs().sum() > 0) for g in gathered]
    frozen = all(p.grad is None for expert in teacher.experts for p in expert.parameters())
    del model  # as tests/core/test_distributed.py's _ddp_check: the reducer dropped while the group lives
    gc.collect()
    time.sleep(0.2)
    return [all(found), frozen]


def test_ddp_averages_a_lora_fake_scores_adapter_gradients_over_ranks(two_ranks):
    assert [r["_lora_ddp_check"] for r in two_ranks] == [[True, True], [True, True]]


def test_what_dmd_cannot_do_is_refused_in_one_line():
    with refused("method.fake_updates=0 must be a positive integer"):
        OPTION.build(fake_updates=0)
    with refused("method.regression_weight=-1.0 must be 0 or more"):
        OPTION.build(regression_weight=-1.0)
    with refused("method.fake_score=teacher trains a teacher-shaped network on the training device (cpu), and "
                 "teacher_placement=disk keeps the teacher off it"):  # fmt: skip
        OPTION.build(fake_score="teacher").check(DiskPlacement(), 1, torch.device("cpu"))
    with refused("method.lora_rank=0 must be a positive integer"):
        OPTION.build(fake_score="lora", lora_rank=0)
    lora, cpu = OPTION.build(fake_score="lora"), torch.device("cpu")
    lora.check(CpuPlacement(), 1, cpu)
    lora.check(DiskPlacement(), 1, cpu)  # streamed: each block recomputed in backward
    for placement in (BalancedPlacement(debug_cpu=True), Gpu0Placement(debug_cpu=True)):  # a device map; an owner's
        with refused(f"method.fake_score=lora backpropagates through the frozen teacher on the training device (cpu), "
                     f"and teacher_placement={placement.name} cannot; use method.fake_score=student, or "
                     f"teacher_placement=gpu or offload or disk or cpu"):  # fmt: skip
            lora.check(placement, 2, cpu)
    with refused(
        "method.fake_score=lora runs the teacher on every training rank, and teacher_placement=cpu with 2 "
        "processes serves ranks that hold none; use distributed.nproc_per_node=1, teacher_placement=gpu"
    ):
        lora.check(CpuPlacement(), 2, cpu)
    # an fp8 base trains adapters (teacher/fp8.py's backward to the input): resident and streamed alike
    for placement in (CpuPlacement(), DiskPlacement()):
        lora.check(placement, 1, cpu, OmegaConf.create({"quantize": "fp8", "compile": False}))
    # a compiled teacher takes the fake score's adapters (teacher/lora.py), unless torch.compile cannot run here
    compiled = OmegaConf.create({"quantize": None, "compile": True})
    lora.check(CpuPlacement(), 1, cpu, compiled)
    with refused("teacher.compile=true with method.fake_score=lora compiles the adapted teacher's blocks on cpu, and "
                 "its CPU backend needs a C++ compiler (c++: not on PATH); drop teacher.compile"):  # fmt: skip
        with unavailable_compile("its CPU backend needs a C++ compiler (c++: not on PATH)"):
            lora.check(CpuPlacement(), 1, cpu, compiled)


DEDICATED = ["teacher_placement=gpu0", "teacher_placement.debug_cpu=true", "distributed.nproc_per_node=2"]


@pytest.mark.parametrize("placement", [["teacher_placement=balanced", "teacher_placement.debug_cpu=true"], DEDICATED])
def test_a_lora_fake_score_where_the_placement_cannot_backpropagate_is_refused_before_the_run_folder(
    make_cfg, tmp_path, placement
):
    """Before the planner, which would call the placement a misfit for it (0 GiB: its estimate refused)."""
    with pytest.raises(UserError) as e:
        run(make_cfg(*FAST, "method.fake_score=lora", *placement, run_dir=tmp_path / "r"))
    assert str(e.value).startswith("method.fake_score=lora backpropagates through the frozen teacher")
    assert "\n" not in str(e.value) and not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["method.steps=0"], "error: method.steps=0 must be at least 1 (a K-step student); e.g. method.steps=4"),
        pytest.param(  # the rest in the slow lane: each a fresh process (~5 s); preflight's unit tests cover them here
            ["method.steps=30"],
            "error: method.steps=30 is more than the teacher's sample steps (method.teacher_steps=20): a few-step "
            "student takes fewer; lower method.steps or raise method.teacher_steps",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["trainer.loss.hidden_kd_weight=0.5"],
            "error: method=dmd trains with its own loss and ignores trainer.loss, which sets "
            "trainer.loss.hidden_kd_weight=0.5; drop it (loss=distillation as it ships), or train with method=kd",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["method=trajectory", "loss=features"],
            "error: method=trajectory trains with its own loss and ignores trainer.loss, which sets "
            "loss=features; drop it",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["method.fake_score=lora", "teacher_placement=balanced", "teacher_placement.debug_cpu=true"],
            "error: method.fake_score=lora backpropagates through the frozen teacher on the training device (cpu), "
            "and teacher_placement=balanced cannot; use method.fake_score=student, or teacher_placement=gpu or "
            "offload or disk or cpu",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["trainer.teacher_whole_step=true"],
            "error: trainer.teacher_whole_step=true rebuilds a step's inputs from the seed, and method=dmd calls "
            "the teacher at the student's own samples; drop trainer.teacher_whole_step",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_the_cli_refuses_a_bad_method_with_one_line_and_exit_2(tmp_path, cache_dir, overrides, line):
    folder = tmp_path / "r"
    result = run_cli(f"hydra.run.dir={folder}", f"paths.cache_dir={cache_dir}", "logger=none", "method=dmd",
                     *overrides)  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().startswith(line) and len(result.stderr.strip().splitlines()) == 1
    assert not folder.exists()  # nothing claimed: the refused run leaves no folder


IMAGE_CASES = [  # (twin, student, fake score): the default lane one of each; the rest in the slow lane
    ("tiny_i2v", "half", "student"),
    ("tiny_i2v", "lora", "lora"),
    ("tiny_i2v_moe", "lora", "lora"),
    pytest.param("tiny_i2v", "half", "teacher", marks=pytest.mark.slow),
    pytest.param("tiny_i2v", "half", "lora", marks=pytest.mark.slow),
    pytest.param("tiny_i2v_moe", "half", "student", marks=pytest.mark.slow),
    pytest.param("tiny_ti2v", "half", "student", marks=pytest.mark.slow),
    pytest.param("tiny_ti2v", "lora", "lora", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("twin,student,fake_score", IMAGE_CASES)
def test_dmd_trains_students_of_image_to_video_teachers_each_sample_drawn_from_its_prompts_image(
    make_cfg, tmp_path, twin, student, fake_score
):
    """`data=image_folder` on an image-to-video twin: the student samples from each prompt's image, and the teacher
    (the real score) and the fake score (a copy, the teacher's shape or adapters on it) take that image too."""
    from tests.data.sources.test_images import given_images, pairs

    root = given_images(tmp_path / "images", (72, 72))
    overrides = [*pairs(root, f"teacher={twin}", f"student={student}", f"method.fake_score={fake_score}"), *FAST]
    if twin == "tiny_ti2v":  # its VAE is 16x in space: 4x4 latents are 64x64 frames
        overrides.append("data.latent_frames=2")
    run(make_cfg(*overrides, "trainer.max_steps=2", run_dir=tmp_path / "r"))
    rows = metrics_steps(tmp_path / "r")
    assert len(rows) == 2 and all(r["loss_dmd"] > 0 and r["loss_fake_score"] > 0 for r in rows)


@pytest.mark.parametrize(
    "twin,method",
    [
        ("tiny_i2v", ["method=trajectory"]),
        pytest.param(
            "tiny_i2v_moe",
            ["method=dmd", "method.regression_weight=0.5", "method.fake_updates=1"],
            marks=pytest.mark.slow,
        ),
        pytest.param("tiny_ti2v", ["method=trajectory", "data.latent_frames=2"], marks=pytest.mark.slow),
        pytest.param(
            "tiny_i2v", ["method=dmd", "method.regression_weight=0.5", "student=lora"], marks=pytest.mark.slow
        ),
    ],
)
def test_the_methods_that_sample_the_teachers_ode_train_on_an_image_to_video_teacher_from_each_prompts_image(
    make_cfg, tmp_path, twin, method
):
    """trajectory, and dmd's regression term: the teacher's ODE runs in its own image-to-video pipeline from each
    training prompt's image (the held-out caption's is not among them) and the student is fed that image (without
    it an image-to-video student cannot run); the cache is keyed on the images, so other images make their own."""
    from tests.data.sources.test_images import given_images, pairs

    common = ["method.steps=2", "method.teacher_steps=3", "method.noises_per_prompt=1", "trainer.batch_size=2"]
    for name, size in (("a", (72, 72)), ("b", (80, 80))):
        root = given_images(tmp_path / f"images_{name}", size)
        overrides = [*pairs(root, f"teacher={twin}"), *method, *common, f"paths.cache_dir={tmp_path / 'cache'}"]
        run(make_cfg(*overrides, "trainer.log_every=1", run_dir=tmp_path / name))
        rows = metrics_steps(tmp_path / name)
        term = "loss_trajectory" if "method=trajectory" in method else "loss_regression"
        assert len(rows) == 2 and all(r[term] > 0 for r in rows)
    made = sorted((tmp_path / "cache" / "trajectories").glob("*/complete.json"))
    # Two image folders, two banks of 2 trajectories each (the 2 training prompts of the 3: one is held out).
    assert len(made) == 2 and all('"items": 2' in m.read_text() for m in made)
