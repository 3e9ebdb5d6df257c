"""`wandistiller.student.model`: named and config.json students, checked against the teacher, started from it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import refused
from wandistiller.core.distributed import Topology
from wandistiller.core.errors import UserError
from wandistiller.core.precision import Precision
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.student import prune
from wandistiller.student.model import build_student, student_config
from wandistiller.teacher.spec import inspect_teacher

TINY_STUDENT = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=2)


def init_from_teacher(student, spec, keep_blocks="even") -> dict:
    """Fill the student with the teacher's weights, cut to its shape (evenly spaced blocks unless told)."""
    return prune.prune_into(student.transformer, spec.path / "transformer", spec.transformer_config, keep_blocks)


def scfg(**kw):
    return OmegaConf.create({"builder": None, "config_path": None, "init": "random"} | kw)


def test_named_students_inherit_what_must_match_the_teacher(tiny_path):
    spec = inspect_teacher(tiny_path)
    config = student_config(scfg(builder="small"), spec.transformer_config)
    assert config["text_dim"] == 32 and config["in_channels"] == 16 and list(config["patch_size"]) == [1, 2, 2]
    assert config["num_attention_heads"] * config["attention_head_dim"] == 1536


def test_the_half_student_has_the_teachers_widths_at_half_its_blocks_and_starts_from_them(tiny_path):
    from wandistiller.student.model import WIDTHS, starts_from_teacher

    teacher = inspect_teacher(tiny_path).transformer_config
    config = student_config(scfg(builder="half", init="auto"), teacher)
    assert config["num_layers"] == teacher["num_layers"] // 2 == 2
    assert all(config[k] == teacher[k] for k in WIDTHS if k in teacher)
    assert starts_from_teacher(scfg(builder="half", init="auto"), config, teacher)
    with pytest.raises(UserError, match="use one of tiny, small, base, half"):
        student_config(scfg(builder="halve"), teacher)


def test_student_from_a_diffusers_config_json(tmp_path, tiny_path):
    path = tmp_path / "student_config.json"
    path.write_text(
        json.dumps(
            {
                "_class_name": "WanTransformer3DModel",
                "num_attention_heads": 4,
                "attention_head_dim": 8,
                "ffn_dim": 48,
                "num_layers": 3,
            }
        )
    )
    student = build_student(inspect_teacher(tiny_path), **scfg(config_path=str(path)))
    assert len(student.transformer.blocks) == 3 and student.transformer.config.text_dim == 32


@pytest.mark.parametrize(
    "override,key",
    [({"text_dim": 4096}, "text_dim"), ({"in_channels": 48}, "in_channels"), ({"patch_size": [1, 4, 4]}, "patch_size")],
)
def test_a_student_that_does_not_fit_the_teacher_is_refused_naming_the_key(tmp_path, tiny_path, override, key):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 1} | override))
    with pytest.raises(UserError, match=rf"{key}=.* but the teacher has {key}="):
        build_student(inspect_teacher(tiny_path), **scfg(config_path=str(path)))


def test_unknown_keys_and_missing_files_are_refused(tmp_path, tiny_path):
    spec = inspect_teacher(tiny_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_layer": 2}))
    with pytest.raises(UserError, match="num_layer"):
        build_student(spec, **scfg(config_path=str(path)))
    with pytest.raises(UserError, match="does not exist"):
        build_student(spec, **scfg(config_path=str(tmp_path / "nope.json")))
    with pytest.raises(UserError, match="student.builder='huge' is unknown"):
        build_student(spec, **scfg(builder="huge"))


def test_init_from_teacher_needs_the_teachers_width(tiny_path):
    with pytest.raises(UserError, match="student.init=teacher"):
        build_student(inspect_teacher(tiny_path), **scfg(builder="small", init="teacher"))


def test_a_full_depth_student_initialised_from_the_teacher_predicts_like_it(tmp_path, tiny_path):
    spec = inspect_teacher(tiny_path)
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                k: spec.transformer_config[k]
                for k in ("num_attention_heads", "attention_head_dim", "ffn_dim", "num_layers")
            }
        )
    )
    student = build_student(spec, **scfg(config_path=str(path), init="teacher"))
    teacher = CpuPlacement().load(
        spec,
        OmegaConf.create({"guidance_scale": 1.0, "guidance_scale_2": None}),
        Precision("fp32", torch.float32, torch.float32, None),
        Topology(),
    )
    init_from_teacher(student, spec)
    x, t, cond = torch.randn(2, 16, 1, 8, 8), torch.tensor([500.0, 20.0]), torch.randn(2, 512, 32)
    with torch.no_grad():
        pred, _ = student(x, t, cond)
        expected = teacher.experts[0](hidden_states=x, timestep=t, encoder_hidden_states=cond, return_dict=False)[0]
    torch.testing.assert_close(pred, expected)


def test_hidden_state_distillation_projects_to_the_teachers_width(tiny_path):
    student = build_student(inspect_teacher(tiny_path), **scfg(builder="tiny"), hidden_layers=(0, -1))
    pred, hidden = student(torch.randn(2, 16, 1, 8, 8), torch.tensor([500.0, 20.0]), torch.randn(2, 512, 32))
    assert pred.shape == (2, 16, 1, 8, 8) and [h.shape for h in hidden] == [(2, 16, 32)] * 2  # one per block
    assert build_student(inspect_teacher(tiny_path), **scfg(builder="tiny")).hidden_proj is None


def test_a_checkpoint_of_one_projection_resumes_into_the_first(tiny_path):
    from diffusers.training_utils import EMAModel

    from wandistiller.state.checkpoint import restore

    student = build_student(inspect_teacher(tiny_path), **scfg(builder="tiny"), hidden_layers=(-1,))
    state = student.state_dict()
    old = {k.replace("hidden_proj.0.", "hidden_proj."): v.clone() + 1 for k, v in state.items()}  # as saved before
    optimizer = torch.optim.AdamW(student.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    saved = {"student": old, "optimizer": optimizer.state_dict(), "lr_scheduler": scheduler.state_dict(),
             "scaler": scaler.state_dict(), "ema": None}  # fmt: skip
    restore(saved, student, optimizer, scheduler, scaler, EMAModel(student.parameters()))
    assert torch.equal(student.hidden_proj[0].weight, old["hidden_proj.weight"])


@pytest.mark.parametrize(
    "body,message",
    [
        ("[1, 2]", "holds a JSON array, not an object"),
        ('"hello"', "holds a JSON string, not an object"),
        ("null", "holds a JSON null"),
        ("{num_layers: 2", "is not valid JSON"),
        ("", "is not valid JSON"),
        (TINY_STUDENT | {"num_layers": -1}, "num_layers=-1 must be a positive integer"),
        (TINY_STUDENT | {"num_layers": 0}, "num_layers=0 must be a positive integer"),
        (TINY_STUDENT | {"num_layers": 1.5}, "num_layers=1.5 must be a positive integer"),
        (TINY_STUDENT | {"num_layers": "2"}, 'num_layers="2" must be a positive integer'),
        (TINY_STUDENT | {"num_layers": True}, "num_layers=true must be a positive integer"),
        ('{"num_layers": NaN}', "num_layers=NaN must be a positive integer"),
        (TINY_STUDENT | {"num_attention_heads": 0}, "num_attention_heads=0 must be a positive integer"),
        (TINY_STUDENT | {"ffn_dim": -4}, "ffn_dim=-4 must be a positive integer"),
        (TINY_STUDENT | {"attention_head_dim": 15}, "attention_head_dim=15 must be even"),
        (TINY_STUDENT | {"attention_head_dim": 4}, "attention_head_dim=4 must be even and at least 6"),
        (TINY_STUDENT | {"eps": "x"}, 'eps="x" must be a positive number'),
        (TINY_STUDENT | {"patch_size": [1, 2]}, "patch_size=[1, 2] must be three positive integers"),
    ],
)
def test_a_bad_student_config_json_is_one_line_naming_the_file(tmp_path, tiny_path, body, message):
    path = tmp_path / "student.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    cfg = SimpleNamespace(init="auto", builder=None, config_path=str(path))
    with pytest.raises(UserError) as e:
        student_config(cfg, inspect_teacher(tiny_path).transformer_config)
    assert f"student.config_path='{path}'" in str(e.value) and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_a_folder_given_as_the_student_config_is_named_a_folder(tmp_path, tiny_path):
    cfg = SimpleNamespace(init="auto", builder=None, config_path=str(tmp_path))
    with refused("is a folder; give the WanTransformer3DModel config.json"):
        student_config(cfg, inspect_teacher(tiny_path).transformer_config)


def test_an_image_to_video_teachers_students_take_its_image_tokens_at_their_own_width(tmp_path):
    from wandistiller.core.arch import TINY_I2V_MOE_TRANSFORMER, TINY_I2V_TRANSFORMER

    small = student_config(scfg(builder="small"), dict(TINY_I2V_TRANSFORMER))
    assert (small["in_channels"], small["out_channels"], small["image_dim"]) == (36, 16, 24)
    assert small["added_kv_proj_dim"] == 1536  # its own width, not the teacher's 32
    half = student_config(scfg(builder="half"), dict(TINY_I2V_TRANSFORMER))
    assert half["added_kv_proj_dim"] == 32 and half["num_layers"] == 2
    a14b = student_config(scfg(builder="tiny"), dict(TINY_I2V_MOE_TRANSFORMER))
    assert a14b["in_channels"] == 36 and a14b.get("image_dim") is None and a14b.get("added_kv_proj_dim") is None
    path = tmp_path / "student.json"
    path.write_text(json.dumps(TINY_STUDENT | {"added_kv_proj_dim": 64}))
    with refused("added_kv_proj_dim=64 but the student's blocks are 32 wide"):
        student_config(scfg(config_path=str(path)), dict(TINY_I2V_TRANSFORMER))
