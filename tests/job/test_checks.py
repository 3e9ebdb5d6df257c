"""Issue 16 leftovers: student and size values that used to fail late or silently, and a wandb project name
wandb refuses; each is one line naming the key, before the run folder is claimed or anything heavy loads. Real Hydra
compose, real tiny teacher, real wandb settings check."""

from __future__ import annotations

import json

import pytest

from wandistiller.core.errors import UserError
from wandistiller.train import run

TINY_STUDENT = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=2)


def refused_run(make_cfg, tmp_path, *overrides):
    with pytest.raises(UserError) as e:
        run(make_cfg(*overrides, run_dir=tmp_path / "r"))
    assert "\n" not in str(e.value) and not (tmp_path / "r").exists()
    return str(e.value)


@pytest.mark.parametrize(
    "body,message",
    [
        (TINY_STUDENT | {"qk_norm": "layer_norm_typo"}, 'qk_norm="layer_norm_typo" is not one diffusers\' Wan applies'),
        (TINY_STUDENT | {"rope_max_seq_len": 10**9}, "rope_max_seq_len=1000000000 allocates"),
        (TINY_STUDENT | {"image_dim": 64}, "image_dim=64 but the teacher has image_dim=None"),
        (TINY_STUDENT | {"num_layers": 10**9}, "student num_layers=1000000000: ~"),
        (TINY_STUDENT | {"ffn_dim": 10**12}, "student ffn_dim=1000000000000: ~"),
        ("[" * 100000 + "]" * 100000, "is nested too deeply to read"),
        ('{"a": ' * 50000 + "1" + "}" * 50000, "is nested too deeply to read"),
    ],
)
def test_a_student_json_that_would_fail_late_is_one_line_first(make_cfg, tmp_path, body, message):
    path = tmp_path / "student.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    error = refused_run(make_cfg, tmp_path, "student=from_json", f"student.config_path={path}")
    assert message in error, error


def test_a_latent_grid_past_the_rope_table_is_refused_naming_the_data_key(make_cfg, tmp_path):
    # the tiny teacher's rope_max_seq_len is 32: 80 rows are 40 patches, which would fail inside the first forward
    error = refused_run(make_cfg, tmp_path, "data.latent_height=80")
    assert error.startswith("data.latent_height=80 is 40 patches") and "rope_max_seq_len=32" in error, error


@pytest.mark.parametrize(
    "override,message",
    [
        ("teacher.max_sequence_length=100000000", "teacher.max_sequence_length=100000000 must be in [1, 4096]"),
        ("data.latent_width=1000000", "data.latent_width=1000000 must be at most 1024"),
        ("data.latent_frames=99999", "data.latent_frames=99999 must be at most 1024"),
        ("seed=99999999999999999999", "seed=99999999999999999999 must be in [0, 2**63)"),
        ("trainer.optimizer.lr=1e30", "trainer.optimizer.lr=1e+30 must be a finite number"),
    ],
)
def test_huge_sizes_seeds_and_rates_are_refused_before_the_run_folder(make_cfg, tmp_path, override, message):
    assert message in refused_run(make_cfg, tmp_path, override)


def test_a_student_too_big_for_the_host_names_the_key(make_cfg, tmp_path):
    # hardware.host_memory_gib plans on paper: a base (1.4B) student's float32 weights need ~5 GiB
    error = refused_run(make_cfg, tmp_path, "student=base", "hardware.host_memory_gib=1", "data.latent_height=8")
    assert "student ffn_dim=8960: ~5.3 GiB" in error and "1.0 GiB of host memory" in error, error


@pytest.mark.parametrize("project", ["team/run", "what?", "a" * 129])
def test_a_project_name_wandb_refuses_is_one_line_before_the_run_folder(make_cfg, tmp_path, project):
    error = refused_run(make_cfg, tmp_path, "logger=wandb", f"logger.wandb.project='{project}'")
    assert error.startswith(f"logger.wandb.project={project!r}: a wandb project name may not contain"), error
    assert "use e.g. logger.wandb.project=wandistiller" in error
