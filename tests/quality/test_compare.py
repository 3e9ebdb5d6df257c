"""`wandistiller.quality.compare`: prompt set and a row's scores from known inputs; rows composed (slow)."""

from __future__ import annotations

import math

import pytest
import torch

from wandistiller.pocket.classifier import load_classifier
from wandistiller.pocket.digits import PROMPTS, rendered_split
from wandistiller.quality.compare import ROWS, Settings, prompt_set, score


def test_the_prompt_set_is_every_pocket_prompt_or_the_first_n_in_the_small_mode():
    assert prompt_set(Settings()) == PROMPTS and len(PROMPTS) == 40
    assert prompt_set(Settings(prompts=6)) == PROMPTS[:6]


def test_a_rows_score_is_the_judges_accuracy_the_distance_to_the_teachers_latents_and_what_it_measured():
    images, _, prompts = rendered_split("heldout", copies=1, seed=7)
    reference = images[80:160]  # other held-out digits: 80 against 80, past the 65 FID needs, keeps passes short
    images, prompts = images[:80], prompts[:80]  # real digits drawn as asked: what a perfect student makes
    latents = torch.zeros(80, 16, 1, 4, 4)
    made = {"latents": latents, "images": images, "prompts": prompts, "params": 1234, "s_per_image": 0.25}
    judge = load_classifier()
    scores = score(made, latents + 0.5, judge, reference)
    assert set(scores) == {"prompt_accuracy", "fid", "kid", "diversity", "latent_mse", "params", "s_per_image"}
    assert scores["latent_mse"] == pytest.approx(0.25) and scores["params"] == 1234 and scores["s_per_image"] == 0.25
    assert scores["prompt_accuracy"] >= 0.9
    # Against other held-out digits the judge's features are near; against noise they are far.
    noise = made | {"images": torch.rand(80, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
    assert scores["fid"] * 5 < score(noise, latents, judge, reference)["fid"]
    # From fewer images than the judge has features FID and KID mean nothing: withheld (nan), never a number.
    few = score(made | {"images": images[:40], "prompts": prompts[:40], "latents": latents[:40]}, latents[:40],
                judge, reference)  # fmt: skip
    assert math.isnan(few["fid"]) and math.isnan(few["kid"]) and few["prompt_accuracy"] >= 0.9


@pytest.mark.slow  # five compositions of the config tree, ~2 s
def test_every_row_composes_with_the_data_and_loss_its_name_says(make_cfg):
    composed = {name: make_cfg("teacher=pocket", "student=half", *overrides) for name, overrides in ROWS}
    sources = {name: cfg.data.latents for name, cfg in composed.items()}
    losses = {name: cfg.trainer.loss._target_.rsplit(".", 1)[-1] for name, cfg in composed.items()}
    assert list(sources.values()) == ["gaussian", "teacher", "images", "images", "images"]
    assert list(losses.values()) == ["Distillation", "Distillation", "Distillation", "Task", "Blend"]
    assert composed["blend 0.5 task + 0.5 KD, images"].trainer.loss.alpha == 0.5
    # Only where x0 comes from and the loss differ: the same student, steps and batch in every row.
    assert len({(cfg.student.builder, cfg.trainer.max_steps, cfg.trainer.batch_size) for cfg in composed.values()}) == 1


def test_a_work_folder_trained_for_more_steps_is_refused_not_reported_as_fewer(tmp_path, cache_dir):
    """A comparison run again with the same --work takes a finished student only at its own --steps: a shorter
    --steps found it "already finished" and reported the longer-trained student under the shorter count."""
    from wandistiller.core.errors import UserError
    from wandistiller.quality.compare import train_student

    two = Settings(student="tiny", seeds=(0,), max_steps=2, batch_size=2)
    run_dir, kd = tmp_path / "seed0" / "kd", ["data=pocket_digits", "method=kd"]
    assert train_student(two, kd, 0, run_dir, cache_dir)["final_step"] == 2
    kept = [p for p in run_dir.rglob("*") if p.is_file() and ".hydra" not in p.parts]  # a resume notes itself there
    before = {p: p.read_bytes() for p in kept}
    assert train_student(two, kd, 0, run_dir, cache_dir)["final_step"] == 2  # taken as it is
    with pytest.raises(UserError, match=r"holds a student trained 2 steps, more than --steps 1; give --steps 2"):
        train_student(Settings(student="tiny", seeds=(0,), max_steps=1, batch_size=2), kd, 0, run_dir, cache_dir)
    assert {p: p.read_bytes() for p in kept} == before  # the finished run untouched


def test_a_jobs_refusal_names_this_commands_flags_not_the_keys_it_set():
    # An audit's: `quality --batch-size 100000000` was told "it would with trainer.batch_size=30314"
    from wandistiller.quality.compare import as_flags

    line = "teacher_placement=cpu will not fit: …; it would with trainer.batch_size=30314 or trainer.max_steps=5"
    assert as_flags(line) == "teacher_placement=cpu will not fit: …; it would with --batch-size 30314 or --steps 5"
