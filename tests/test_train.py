"""`wandistiller.train`: end to end through `run(cfg)` and the CLI (fresh processes): training, resume, outputs,
sweeps, and every user mistake; also the behaviours of modules outside the CLIs' tests that a whole run shows."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel
from hydra.utils import instantiate

from tests.conftest import cli, fresh_runs, metrics_steps, run_cli
from wandistiller.core.errors import UserError
from wandistiller.data.latents import load_latent_bank
from wandistiller.state.checkpoint import load_checkpoint
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.train import run

SLURM = bool(shutil.which("sbatch"))  # a Slurm machine: the sweep would be submitted


def mean(xs):
    return sum(xs) / len(xs)


def losses(run_dir):
    return [r["loss"] for r in metrics_steps(run_dir)]


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


@pytest.mark.slow  # each of these options trains in its own default-lane test; together, in the slow lane
def test_two_experts_ema_accumulation_checkpointing_and_hidden_kd_together(make_cfg, tmp_path):
    run_dir = tmp_path / "r"
    summary = run(
        make_cfg(
            "teacher=tiny_moe",
            "trainer.max_steps=4",
            "trainer.grad_accum_steps=2",
            "trainer.gradient_checkpointing=true",
            "trainer.ema_decay=0.5",
            "trainer.loss.hidden_kd_weight=0.1",
            "precision=bf16",
            "hooks=[monitor,progress,samples,evaluate]",
            "hooks.samples.prompts=2",
            "hooks.samples.steps=2",
            "hooks.evaluate.steps=2",
            run_dir=run_dir,
        )
    )
    assert summary["teacher_experts"] == 2 and summary["batch_size"] == 8
    steps = metrics_steps(run_dir)
    assert all(s["loss_hidden"] > 0 and s["teacher_ms"] > 0 and s["host_peak_rss_gib"] > 0 for s in steps)
    assert (run_dir / "student_ema" / "config.json").is_file()
    assert (run_dir / "samples.png").stat().st_size > 1000


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
        ("paths.cache_dir=", "paths.cache_dir is empty; give it a folder, e.g. paths.cache_dir=~/.cache/wandistiller"),
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


@pytest.fixture(scope="module", autouse=True)  # autouse: they start with the module, beside its in-process tests
def clis(request, tmp_path_factory, cache_dir, tiny_path):
    """This module's default-lane command-line runs (each a fresh process), started together with the module;
    all but "bad" with the folder each uses."""
    folder = {key: tmp_path_factory.mktemp("cli") for key in ("bad", "plain", "sweep", "slurm")}
    args = cli(f"hydra.run.dir={folder['bad'] / 'r'}", f"paths.cache_dir={cache_dir}", "trainer.batch_size=0",
               "logger=none")  # fmt: skip
    plain = cli(f"hydra.run.dir={folder['plain'] / 'run'}", "trainer.max_steps=2", "logger=none", "debug=fast")
    sweep = cli("-m", f"hydra.sweep.dir={folder['sweep'] / 'sweep'}", "teacher_placement=cpu,gpuu")
    on_slurm = f"hydra.sweep.dir={folder['slurm'] / 's'}"
    slurm = cli("-m", "hydra/launcher=slurm", "hydra.launcher.partition=gpu", on_slurm, "teacher_placement=gpu,gpu0")
    started = fresh_runs(request, {
        "bad": ("test_cli_bad_input_is_one_line_and_a_non_zero_exit", args),
        "plain": ("test_the_cli_run_has_no_float32_warning_and_ends_with_done", plain),
        "sweep": ("test_a_sweeps_typo_in_any_value_is_one_line_before_any_point_runs", sweep),
        "slurm": ("" if SLURM else "test_slurm_off_a_cluster_is_one_line_and_leaves_no_sweep_folder", slurm),
    })  # fmt: skip
    return {key: run if key == "bad" else (run, folder[key]) for key, run in started.items()}


def test_cli_bad_input_is_one_line_and_a_non_zero_exit(clis):
    result = clis["bad"].result()
    assert result.returncode == 2
    assert result.stderr.strip() == "error: trainer.batch_size=0 must be a positive integer"
    assert "Traceback" not in result.stdout


def test_the_cli_run_has_no_float32_warning_and_ends_with_done(clis):
    result = clis["plain"][0].result()
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-2000:]
    assert "should be kept in float32" not in out and "outputs in" in out.splitlines()[-1]


def test_a_sweeps_typo_in_any_value_is_one_line_before_any_point_runs(clis):
    future, tmp_path = clis["sweep"]
    result = future.result()
    assert result.returncode == 2 and "teacher_placement/gpuu" in result.stderr and result.stderr.count("\n") == 1
    assert not (tmp_path / "sweep").exists()


@pytest.mark.skipif(SLURM, reason="a Slurm machine: the sweep would be submitted")
def test_slurm_off_a_cluster_is_one_line_and_leaves_no_sweep_folder(clis):
    future, tmp_path = clis["slurm"]
    result = future.result()
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "sbatch" in result.stderr
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_cli_default_job_with_wandb_offline_and_resume_keeps_the_run_id(tmp_path, cache_dir, tiny_path):
    run_dir = tmp_path / "r"
    args = [
        f"hydra.run.dir={run_dir}",
        f"paths.cache_dir={cache_dir}",
        "trainer.max_steps=4",
        "trainer.checkpoint_every=2",
        "hooks.samples.steps=2",
        "hooks.evaluate.steps=2",
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


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [["method=kd"], ["method=dmd", "method.steps=2", "method.fake_score=lora", "method.lora_rank=2"]],
    ids=["kd", "dmd_lora_fake_score"],
)
def test_a_lora_student_on_a_compiled_teacher_trains_like_on_an_eager_one(make_cfg, tmp_path, method):
    # teacher.compile=true with student=lora: the adapted blocks compiled, switched on for the student's calls (and
    # dmd's fake score's) and off for the teacher's (teacher/lora.py); the eager run's loss within the compile
    # tolerance
    common = ["student=lora", "student.rank=2", "trainer.max_steps=2", "trainer.batch_size=2", *method]
    eager = run(make_cfg(*common, run_dir=tmp_path / "eager"))
    compiled = run(make_cfg(*common, "teacher.compile=true", run_dir=tmp_path / "c"))
    assert compiled["steps_run"] == 2
    assert abs(compiled["loss_last"] - eager["loss_last"]) < 1e-3 * max(eager["loss_last"], 1e-6) + 1e-6


def test_compiling_a_teacher_spread_by_accelerate_is_refused(make_cfg, tmp_path):
    overrides = ["teacher_placement=balanced", "teacher_placement.debug_cpu=true", "teacher.compile=true"]
    with pytest.raises(UserError, match="teacher.compile=true works with the placements that run a whole teacher"):
        run(make_cfg(*overrides, run_dir=tmp_path / "r"))


def test_a_short_run_is_quiet_leaves_loss_png_and_resume_auto_says_where_it_looked(make_cfg, tmp_path, caplog):
    folder = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        run(make_cfg("trainer.max_steps=2", "trainer.resume=auto", "teacher_placement=auto", run_dir=folder))
    text = caplog.text
    assert f"trainer.resume=auto: no checkpoint in {folder / 'checkpoints'}; starting from step 0" in text
    assert "teacher placement: cpu (host" in text and "placement plan:" not in text  # one line, not the table
    assert "41.9K params" in text
    assert (folder / "loss.png").is_file()  # 2 steps: no validation ran, the curve is still drawn


def test_a_resumed_runs_wandb_sync_hint_names_every_segment(make_cfg, tmp_path, caplog):
    folder = tmp_path / "run"
    run(make_cfg("trainer.max_steps=2", "trainer.checkpoint_every=1", "logger=wandb", run_dir=folder))
    with caplog.at_level(logging.INFO):
        run(make_cfg("trainer.max_steps=4", "trainer.resume=auto", "logger=wandb", run_dir=folder))
    segments = sorted((folder / "wandb").glob("offline-run-*"))
    # offline-run-<date>_<time>-<id>, with "-1" added by wandb when both started in the same second
    assert len(segments) == 2 and len({p.name.split("-")[3] for p in segments}) == 1  # one run id
    hint = next(r.getMessage() for r in caplog.records if "wandb sync" in r.getMessage())
    assert all(str(p) in hint for p in segments)


def test_a_checkpoint_continued_in_a_new_folder_is_a_wandb_run_of_its_own(make_cfg, tmp_path):
    # An audit's: the fork logged under the original run's id, so once both were synced its steps went into that run.
    first, fork = tmp_path / "run", tmp_path / "fork"
    run(make_cfg("trainer.max_steps=2", "trainer.checkpoint_every=1", "logger=wandb", run_dir=first))
    checkpoint = first / "checkpoints" / "step_00000002"
    run(make_cfg("trainer.max_steps=3", f"trainer.resume={checkpoint}", "logger=wandb", run_dir=fork))
    ids = [{p.name.split("-")[3] for p in (folder / "wandb").glob("offline-run-*")} for folder in (first, fork)]
    assert len(ids[0]) == len(ids[1]) == 1 and ids[0] != ids[1]


def test_gpu0_without_gpus_names_the_gpus_not_the_process_count(make_cfg):
    from wandistiller.core.distributed import Topology
    from wandistiller.job.preflight import prepare

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine runs gpu0")
    with pytest.raises(UserError, match="gpu0 needs 2 or more GPUs"):
        prepare(make_cfg("teacher_placement=gpu0"), Topology())


def test_an_image_folder_run_validates_on_held_out_captions_of_its_own(make_cfg, tmp_path, caplog):
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    for i in range(10):
        Image.new("RGB", (64, 64), (20 * i, 90, 200 - 10 * i)).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(f"a plain field number {i}")
    with caplog.at_level(logging.INFO):
        run(make_cfg("data=image_folder", f"data.root={images}", "trainer.max_steps=2", "hooks.monitor.val_every=2",
                     run_dir=tmp_path / "run"))  # fmt: skip
    assert "images: the last 1 of 10 and their captions are held out for validation" in caplog.text
    rows = (tmp_path / "run" / "metrics_steps.jsonl").read_text()
    assert '"val/loss"' in rows


def test_offline_segments_include_the_folders_wandb_suffixes_when_two_start_in_one_second(tmp_path):
    from wandistiller.tracking.loggers.wandb import offline_segments

    names = ["offline-run-20261126_130001-abc", "offline-run-20261126_130001-abc-1", "offline-run-20261126_130002-xyz"]
    for name in names:
        (tmp_path / name).mkdir()
    assert [p.name for p in offline_segments(tmp_path, "abc")] == names[:2]


# -- training on clips ------------------------------------------------------------------------------------------
# Training on clips (data.latent_frames > 1): every method (kd, trajectory, dmd with its fake score, full or
# LoRA) and every student kind (a cut `half`, a LoRA on the teacher; one expert and a pair) trains a few real steps
# on the tiny teacher (its VAE compresses time 4x) at 3 latent frames, validation included; the teacher's own clips
# (data=teacher_latents) are cached as [C, 3, h, w] latents and trained on.

CLIP_RUN = ["data.latent_frames=3", "trainer.max_steps=2", "trainer.batch_size=2", "trainer.log_every=1"]
CLIP_DMD = ["method=dmd", "method.steps=2", "method.fake_updates=1"]
CLIP_RUNS = {
    "kd_cut_half": ["student=half", "hooks.monitor.val_every=1"],
    "dmd_tiny": CLIP_DMD,
    "dmd_half_lora_fake_score": ["student=half", *CLIP_DMD, "method.fake_score=lora"],
    "lora_dmd_pair": ["teacher=tiny_moe", "student=lora", *CLIP_DMD, "method.fake_score=lora"],
    "lora_kd": ["student=lora"],
}


def _clip_losses(folder: Path) -> list[float]:
    losses = [r["loss"] for r in metrics_steps(folder) if "loss" in r]
    assert losses and all(math.isfinite(x) for x in losses)
    return losses


@pytest.mark.parametrize("name", list(CLIP_RUNS))
def test_trains_on_clips(make_cfg, tmp_path, name):
    folder = tmp_path / name
    run(make_cfg(*CLIP_RUN, *CLIP_RUNS[name], run_dir=folder))
    assert len(_clip_losses(folder)) == 2
    assert (folder / "student").is_dir() or (folder / "checkpoints").is_dir()
    if name in ("kd_cut_half", "lora_kd"):
        card_makes_the_clip(folder)


def card_makes_the_clip(folder: Path) -> None:
    """A clip run's card is a text-to-video one, and its snippet (run here) writes the clip: 9 frames (3 latent
    frames through the tiny VAE's 4x) as a GIF."""
    from PIL import Image

    card = (folder / "pipeline" / "README.md").read_text()
    assert "pipeline_tag: text-to-video" in card and "text-to-video student" in card
    assert "| clip size | 9 frames of 64x64 (latent 8x8 per latent frame) |" in card
    (snippet,) = re.findall(r"```python\n(import torch.*?)```", card, re.S)
    cwd = Path.cwd()
    try:
        os.chdir(folder)
        exec(snippet.replace("PATH_OR_REPO", str(folder / "pipeline")), {})
    finally:
        os.chdir(cwd)
    with Image.open(folder / "clip.gif") as gif:
        assert gif.n_frames == 9 and gif.size == (64, 64)


@pytest.mark.slow
def test_trajectory_on_clips(make_cfg, tmp_path):
    folder = tmp_path / "trajectory"
    run(make_cfg(*CLIP_RUN, "method=trajectory", "method.steps=2", "method.teacher_steps=4", run_dir=folder))
    assert len(_clip_losses(folder)) == 2


def test_trains_on_teacher_clips(make_cfg, tmp_path, cache_dir):
    """The teacher's own clips: sampled at 3 latent frames (9 frames through its VAE), cached, trained on."""
    folder = tmp_path / "teacher_clips"
    overrides = ["data=teacher_latents", "data.sample_steps=2", "data.prompts_path=" + str(_clip_prompts(tmp_path))]
    run(make_cfg(*CLIP_RUN, *overrides, run_dir=folder))
    assert len(_clip_losses(folder)) == 2
    banks = [load_latent_bank(p) for p in (cache_dir / "teacher_latents").iterdir()]
    shapes = {b.latent_shape for b in banks if b is not None}
    assert (16, 3, 8, 8) in shapes
    bank = next(b for b in banks if b is not None and b.latent_shape == (16, 3, 8, 8))
    x0 = bank.x0(torch.arange(len(bank)))
    assert torch.isfinite(x0).all() and not torch.equal(x0[:, :, 0], x0[:, :, 2])  # frames differ: a clip


def _clip_prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("a red ball\na blue cube\na green cat\na small dog\n")
    return path
