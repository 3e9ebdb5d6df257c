"""What a new user sees on a first run: few lines, every output whole, the faster CPU precision."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from tests.conftest import cli, fresh_runs
from wandistiller.core.errors import UserError
from wandistiller.core.precision import Precision, cast_keeping_fp32
from wandistiller.train import run

MISTAKES = [
    ("trainer.bacth_size=2", "Key 'bacth_size' not in 'TrainerConfig'; check its spelling"),
    ("teacher_placement=cpuu", "Could not find 'teacher_placement/cpuu'"),
    ("student.init=teachr", "Invalid value 'teachr'"),
]
SLURM = bool(shutil.which("sbatch"))  # a Slurm machine: the sweep would be submitted


@pytest.fixture(scope="module", autouse=True)  # autouse: they start with the module, beside its in-process tests
def clis(request, tmp_path_factory):
    """This module's command-line runs, started together (each a fresh process), each with its own folder."""
    folder = {key: tmp_path_factory.mktemp("cli") for key in ("plain", "sweep", "slurm", *dict(MISTAKES))}
    plain = cli(f"hydra.run.dir={folder['plain'] / 'run'}", "trainer.max_steps=2", "logger=none", "debug=fast")
    sweep = cli("-m", f"hydra.sweep.dir={folder['sweep'] / 'sweep'}", "teacher_placement=cpu,gpuu")
    on_slurm = f"hydra.sweep.dir={folder['slurm'] / 's'}"
    slurm = cli("-m", "hydra/launcher=slurm", "hydra.launcher.partition=gpu", on_slurm, "teacher_placement=gpu,gpu0")
    commands = {
        "plain": ("test_the_cli_run_has_no_float32_warning_and_ends_with_done", plain),
        "sweep": ("test_a_sweeps_typo_in_any_value_is_one_line_before_any_point_runs", sweep),
        "slurm": ("" if SLURM else "test_slurm_off_a_cluster_is_one_line_and_leaves_no_sweep_folder", slurm),
    }
    for override in dict(MISTAKES):
        commands[override] = ("test_hydras_own_mistakes_are_one_line_with_exit_code_2",
                              cli(f"hydra.run.dir={folder[override] / 'run'}", override))  # fmt: skip
    return {key: (started, folder[key]) for key, started in fresh_runs(request, commands).items()}


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


def test_precision_auto_is_fp32_without_cuda_and_the_run_records_the_choice(make_cfg):
    cfg = make_cfg("precision=auto")
    assert Precision.from_config(cfg.precision).name == ("bf16" if torch.cuda.is_available() else "fp32")


def test_casting_keeps_wans_fp32_modules_and_says_nothing(tmp_path, capfd):
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                                  text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32)  # fmt: skip
    cast_keeping_fp32(model, torch.bfloat16)
    assert model.blocks[0].norm2.weight.dtype == torch.float32 and model.scale_shift_table.dtype == torch.float32
    assert model.blocks[0].ffn.net[2].weight.dtype == torch.bfloat16
    assert "float32" not in capfd.readouterr().err


def test_the_cli_run_has_no_float32_warning_and_ends_with_done(clis):
    result = clis["plain"][0].result()
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-2000:]
    assert "should be kept in float32" not in out and "outputs in" in out.splitlines()[-1]


@pytest.mark.parametrize("override,words", MISTAKES)
def test_hydras_own_mistakes_are_one_line_with_exit_code_2(override, words, clis):
    future, tmp_path = clis[override]
    result = future.result()
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ") and words in result.stderr
    assert "+trainer" not in result.stderr and not (tmp_path / "run").exists()  # no hint that is then refused


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
        run(make_cfg("data=image_folder", f"data.root={images}", "trainer.max_steps=2", "trainer.val_every=2",
                     run_dir=tmp_path / "run"))  # fmt: skip
    assert "the last 1 of 10 images and their captions are held out for validation" in caplog.text
    rows = (tmp_path / "run" / "metrics_steps.jsonl").read_text()
    assert '"val/loss"' in rows


def test_offline_segments_include_the_folders_wandb_suffixes_when_two_start_in_one_second(tmp_path):
    from wandistiller.tracking.loggers import offline_segments

    names = ["offline-run-20261126_130001-abc", "offline-run-20261126_130001-abc-1", "offline-run-20261126_130002-xyz"]
    for name in names:
        (tmp_path / name).mkdir()
    assert [p.name for p in offline_segments(tmp_path, "abc")] == names[:2]
