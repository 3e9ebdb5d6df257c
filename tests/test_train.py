"""End to end through `run(cfg)` and the CLI: training, resume, outputs, and every user mistake."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from diffusers import WanTransformer3DModel
from hydra.utils import instantiate

from tests.conftest import cli, fresh_runs, run_cli
from wandistiller.core.errors import UserError
from wandistiller.state.checkpoint import load_checkpoint
from wandistiller.teacher.model import inspect_teacher
from wandistiller.train import run


def mean(xs):
    return sum(xs) / len(xs)


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics_steps.jsonl").read_text().splitlines()]


def test_a_short_run_lowers_the_loss(make_cfg, tmp_path):
    summary = run(
        make_cfg(
            "trainer.max_steps=40",
            "student.init=random",
            "trainer.optimizer.lr=3e-3",
            "trainer.warmup_steps=0",
            run_dir=tmp_path / "r",
        )
    )
    history = losses(tmp_path / "r")
    assert summary["status"] == "completed" and summary["steps_run"] == 40 and len(history) == 40
    assert mean(history[-5:]) < 0.6 * mean(history[:5])


def test_resume_equals_an_uninterrupted_run_bit_for_bit(make_cfg, tmp_path):
    common = ["trainer.max_steps=6", "trainer.checkpoint_every=3", "trainer.batch_size=2", "trainer.ema_decay=0.9"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(make_cfg(*common, run_dir=straight))
    run(make_cfg(*common, run_dir=resumed))
    # A crash after step 3: only the step-3 checkpoint survives.
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")
    for leftover in ("student", "student_ema", "metrics.json", "metrics_steps.jsonl"):
        shutil.rmtree(resumed / leftover) if (resumed / leftover).is_dir() else (resumed / leftover).unlink()
    summary = run(make_cfg(*common, "trainer.resume=auto", run_dir=resumed))
    assert summary["steps_run"] == 3 and summary["final_step"] == 6
    assert losses(resumed) == losses(straight)[3:]
    a = load_checkpoint(straight / "checkpoints/step_00000006")
    b = load_checkpoint(resumed / "checkpoints/step_00000006")
    for key in a["student"]:
        assert torch.equal(a["student"][key], b["student"][key]), key
    assert (resumed / ".hydra" / "config.yaml").is_file() and list((resumed / ".hydra").glob("config_resume_*.yaml"))


def test_the_saved_student_reloads_and_reproduces_its_predictions(make_cfg, tmp_path, tiny_path):
    cfg = make_cfg("trainer.max_steps=3", run_dir=tmp_path / "r")
    run(cfg)
    reloaded = WanTransformer3DModel.from_pretrained(tmp_path / "r" / "student", use_safetensors=True)
    trained = instantiate(cfg.student, _partial_=True)(spec=inspect_teacher(tiny_path))
    trained.load_state_dict(load_checkpoint(tmp_path / "r/checkpoints/step_00000003")["student"])
    x, t, cond = torch.randn(2, 16, 1, 8, 8), torch.tensor([700.0, 30.0]), torch.randn(2, 512, 32)
    with torch.no_grad():
        expected, _ = trained(x, t, cond)
        assert torch.equal(
            reloaded(hidden_states=x, timestep=t, encoder_hidden_states=cond, return_dict=False)[0], expected
        )


def test_two_experts_ema_accumulation_checkpointing_and_hidden_kd_together(make_cfg, tmp_path):
    run_dir = tmp_path / "r"
    summary = run(
        make_cfg(
            "teacher=tiny_moe",
            "trainer.max_steps=4",
            "trainer.grad_accum_steps=2",
            "trainer.gradient_checkpointing=true",
            "trainer.ema_decay=0.5",
            "student.hidden_kd_weight=0.1",
            "precision=bf16",
            "trainer.sample_prompts=2",
            "trainer.sample_steps=2",
            run_dir=run_dir,
        )
    )
    assert summary["teacher_experts"] == 2 and summary["batch_size"] == 8
    steps = [json.loads(line) for line in (run_dir / "metrics_steps.jsonl").read_text().splitlines()]
    assert all(s["loss_hidden"] > 0 and s["teacher_ms"] > 0 and s["host_peak_rss_gib"] > 0 for s in steps)
    assert (run_dir / "student_ema" / "config.json").is_file()
    assert (run_dir / "samples.png").stat().st_size > 1000


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
    assert digest(run_dir) == before


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.batch_size=0", "trainer.batch_size=0 must be a positive integer"),
        ("distributed.nproc_per_node=0", "distributed.nproc_per_node=0 must be a positive integer"),
        ("trainer.max_steps=-1", "trainer.max_steps=-1 must be a positive integer"),
        ("data.latent_height=7", "must be even"),
        ("data.prompts_path=/no/such/prompts.txt", "data.prompts_path='/no/such/prompts.txt' does not exist"),
        ("teacher.path=/no/such/teacher", "teacher.path='/no/such/teacher' does not exist"),
        ("teacher=wan2.1_t2v_1.3b", "could not be fetched from the Hub"),
        ("trainer.resume=/no/such/checkpoint", "trainer.resume='/no/such/checkpoint'"),
    ],
)
def test_bad_input_is_refused_before_training(make_cfg, tmp_path, override, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    extra = ["teacher.builtin=null"] if override.startswith("teacher.path") else []
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("[", r"\[")) as e:
        run(make_cfg(override, *extra, run_dir=tmp_path / "r"))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "r" / "checkpoints").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize(
    "override,message",
    [
        (
            "teacher_placement=gpu",
            "teacher_placement=gpu needs a CUDA GPU and none is visible; use teacher_placement=cpu",
        ),
        ("precision=fp16", "precision=fp16 needs a CUDA GPU and none is visible"),
    ],
)
def test_gpu_only_choices_are_refused_on_a_cpu_machine(make_cfg, tmp_path, override, message):
    with pytest.raises(UserError, match=message):
        run(make_cfg(override, run_dir=tmp_path / "r"))


@pytest.fixture(scope="module", autouse=True)  # autouse: it starts with the module, beside its in-process tests
def clis(request, tmp_path_factory, cache_dir, tiny_path):
    """This module's default-lane command-line run (a fresh process), started with the module."""
    folder = tmp_path_factory.mktemp("cli")
    args = cli(f"hydra.run.dir={folder / 'r'}", f"paths.cache_dir={cache_dir}", "trainer.batch_size=0", "logger=none")
    return fresh_runs(request, {"bad": ("test_cli_bad_input_is_one_line_and_a_non_zero_exit", args)})


def test_cli_bad_input_is_one_line_and_a_non_zero_exit(clis):
    result = clis["bad"].result()
    assert result.returncode == 2
    assert result.stderr.strip() == "error: trainer.batch_size=0 must be a positive integer"
    assert "Traceback" not in result.stdout


@pytest.mark.slow
def test_cli_default_job_with_wandb_offline_and_resume_keeps_the_run_id(tmp_path, cache_dir, tiny_path):
    run_dir = tmp_path / "r"
    args = [
        f"hydra.run.dir={run_dir}",
        f"paths.cache_dir={cache_dir}",
        "trainer.max_steps=4",
        "trainer.checkpoint_every=2",
        "trainer.sample_steps=2",
    ]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    for name in (
        ".hydra/config.yaml",
        ".hydra/overrides.yaml",
        "metrics.json",
        "samples.png",
        "student/config.json",
        "checkpoints/step_00000004/state.json",
        "train.log",
    ):
        assert (run_dir / name).is_file(), name
    offline_runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1
    run_id = offline_runs[0].name.rsplit("-", 1)[-1]
    assert "wandb sync" in first.stdout + first.stderr

    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    (run_dir / "metrics.json").unlink()
    shutil.rmtree(run_dir / "student")
    again = run_cli(*args, "trainer.resume=auto")
    assert again.returncode == 0, again.stderr[-3000:]
    assert {p.name.rsplit("-", 1)[-1] for p in (run_dir / "wandb").glob("offline-run-*")} == {run_id}
    assert json.loads((run_dir / "metrics.json").read_text())["final_step"] == 4


@pytest.mark.slow
def test_regionally_compiled_teacher_and_student_train_like_eager_ones(make_cfg, tmp_path):
    common = ["trainer.max_steps=2", "trainer.batch_size=2"]
    eager = run(make_cfg(*common, run_dir=tmp_path / "eager"))
    compiled = run(make_cfg(*common, "teacher.compile=true", "trainer.compile_student=true", run_dir=tmp_path / "c"))
    assert compiled["steps_run"] == 2
    assert abs(compiled["loss_last"] - eager["loss_last"]) < 1e-3 * max(eager["loss_last"], 1e-6) + 1e-6


def test_compiling_a_teacher_spread_by_accelerate_is_refused(make_cfg, tmp_path):
    overrides = ["teacher_placement=balanced", "teacher_placement.debug_cpu=true", "teacher.compile=true"]
    with pytest.raises(UserError, match="teacher.compile=true works with the placements that run a whole teacher"):
        run(make_cfg(*overrides, run_dir=tmp_path / "r"))
