"""`wandistiller.state.sampling`: counts refused before any work, the VAE's factors read off the teacher's folder (Wan's
where unreadable), and `generate`: the same seed draws the same latents, one per prompt and noise."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import refused
from wandistiller.data.prompts import encode_prompts
from wandistiller.state.runs import open_run
from wandistiller.state.sampling import check_counts, generate, image_scale, load_teacher, time_scale


def test_a_step_count_over_the_teachers_timesteps_or_more_images_than_memory_is_one_line(finished):
    run = open_run(finished)
    top = run.spec.num_train_timesteps
    check_counts(run, {"--steps": top}, 4, "--limit")
    with refused(f"--steps {top + 1} is more than this teacher's {top} training timesteps"):
        check_counts(run, {"--steps": top + 1})
    with refused("--per-prompt asks for 1,000,000,000 images"):
        check_counts(run, {}, 10**9, "--per-prompt")


def test_the_vaes_factors_come_from_its_config_and_wans_where_it_cannot_be_read(tmp_path, tiny_path):
    assert (image_scale(None), time_scale(None)) == (8, 4)  # Wan's
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text('{"scale_factor_spatial": 4, "scale_factor_temporal": 999}')
    assert (image_scale(tmp_path), time_scale(tmp_path)) == (4, 4)  # 999 is no sane factor
    (tmp_path / "vae" / "config.json").write_text("{not json")
    assert image_scale(tmp_path) == 8


@pytest.mark.parametrize("per_prompt", [1, 2])
def test_the_same_seed_draws_the_same_latents_one_per_prompt_and_noise(finished, per_prompt):
    run = open_run(finished)
    t = run.cfg.teacher
    emb = encode_prompts(run.spec, ["a", "b"], t.negative_prompt, t.max_sequence_length, torch.float32,
                         torch.device("cpu"), run.cfg.paths.cache_dir)  # fmt: skip
    teacher = load_teacher(run, torch.device("cpu"), torch.float32)
    one, seconds = generate(teacher, emb, [0, 1], 0, 2, run.latent_shape, per_prompt=per_prompt)
    again, _ = generate(teacher, emb, [0, 1], 0, 2, run.latent_shape, per_prompt=per_prompt)
    assert one.shape == (2 * per_prompt, *run.latent_shape) and len(seconds) == 2 * per_prompt
    assert torch.equal(one, again) and not torch.equal(one[0], one[-1])
