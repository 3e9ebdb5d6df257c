"""Tests wandistiller/job/preflight.py: what `prepare` refuses after the config's own values, in one line before the
run folder is claimed (student and teacher configs and files, the student's room and rope table), through
`train.run` and the functions it calls, on real Hydra compose and the tiny teacher."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from wandistiller.core.errors import UserError
from wandistiller.core.files import folder_problem, safetensors_problem
from wandistiller.student.model import student_config
from wandistiller.teacher.model import inspect_teacher
from wandistiller.train import run

TINY_STUDENT = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=2)


def refused(match: str):
    return pytest.raises(UserError, match=re.escape(match))


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


def _edit_json(rel, change):
    def edit(folder: Path):
        path = folder / rel
        path.write_text(json.dumps(change(json.loads(path.read_text()))))

    return edit


def _rewrite_header(change):
    def edit(folder: Path):
        path = folder / "transformer" / "diffusion_pytorch_model.safetensors"
        data = path.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = change(json.loads(data[8 : 8 + n]))
        raw = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])

    return edit


def _first_tensor_huge(header):
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [0, 10**9]
    return header


WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda f: (f / "model_index.json").write_text("{oops"), "model_index.json is not valid JSON"),
        (lambda f: (f / "model_index.json").write_text("[1]"), "holds a JSON array, not an object"),
        (_edit_json("model_index.json", lambda j: j | {"transformer": None}), "without a WanTransformer3DModel"),
        (_edit_json("model_index.json", lambda j: j | {"transformer": "x"}), "model_index.json's 'transformer' is"),
        (_edit_json("transformer/config.json", lambda j: j | {"num_layers": "four"}), 'num_layers="four"'),
        (_edit_json("transformer/config.json", lambda j: j | {"attention_head_dim": 7}), "attention_head_dim=7"),
        (lambda f: (f / "transformer/config.json").write_text("[]"), "holds a JSON array"),
        (lambda f: (f / WEIGHTS).write_bytes((f / WEIGHTS).read_bytes()[:-100]), "truncated"),
        (lambda f: (f / WEIGHTS).write_bytes(b"\x07" * 5000), "not a safetensors file, or is truncated"),
        (lambda f: (f / WEIGHTS).write_bytes(b""), "0 bytes, too short"),
        (lambda f: (f / "text_encoder/model.safetensors").write_bytes(b"x" * 12), "text_encoder/model.safetensors"),
        (_rewrite_header(lambda h: [1]), "header is not a JSON object"),
        (_rewrite_header(_first_tensor_huge), "is damaged: tensor"),
        (_edit_json("scheduler/scheduler_config.json", lambda j: j | {"flow_shift": "x"}), "flow_shift='x'"),
    ],
)
def test_a_damaged_teacher_folder_is_refused_from_its_files_alone(tmp_path, tiny_path, damage, message):
    folder = tmp_path / "teacher"
    shutil.copytree(tiny_path, folder)
    damage(folder)
    with refused(message) as e:
        inspect_teacher(folder)
    assert "\n" not in str(e.value) and f"teacher.path='{folder}'" in str(e.value)


def test_a_good_safetensors_file_passes_the_header_check(tiny_path):
    assert safetensors_problem(tiny_path / WEIGHTS) is None


def test_a_student_config_with_negative_layers_is_refused_before_the_run_folder(make_cfg, tmp_path):
    path = tmp_path / "student.json"
    path.write_text(json.dumps(TINY_STUDENT | {"num_layers": -1}))
    with refused("num_layers=-1 must be a positive integer"):
        run(make_cfg("student=from_json", f"student.config_path={path}", run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_a_read_only_folder_is_named_read_only(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)],
                                                   capture_output=True).returncode == 0  # fmt: skip
    if not mounted:
        folder.chmod(0o555)
        if os.access(folder, os.W_OK):
            pytest.skip("neither a read-only mount nor a read-only folder can be made here")
    try:
        assert "cannot be written" in folder_problem(folder / "run")
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)


def test_a_folder_as_prompts_path_is_named_a_folder_and_a_bom_is_dropped(tmp_path):
    from wandistiller.data.prompts import read_prompts

    with refused("is a folder; give a text file"):
        read_prompts(str(tmp_path))
    path = tmp_path / "p.txt"
    path.write_bytes("\ufeffa red fox\nsnow\n".encode())
    assert read_prompts(str(path)) == ["a red fox", "snow"]
    path.write_bytes(b"a\x00b\n")
    with refused("holds NUL bytes"):
        read_prompts(str(path))
    with refused("is not a regular file (a pipe or a device)"):
        read_prompts("/dev/null")


def test_a_local_teachers_files_are_checked_before_the_planner_reads_its_config(make_cfg, tmp_path, tiny_path):
    folder = tmp_path / "teacher"
    shutil.copytree(tiny_path, folder)
    _edit_json("transformer/config.json", lambda j: j | {"num_layers": "four"})(folder)
    with refused('transformer/config.json: num_layers="four" must be a positive integer'):
        run(make_cfg(f"teacher.path={folder}", run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_a_teacher_path_that_is_a_symlink_loop_is_named_so(tmp_path):
    from omegaconf import OmegaConf

    from wandistiller.teacher.model import resolve_teacher_path

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with refused("is a symbolic link that leads nowhere"):
        resolve_teacher_path(OmegaConf.create({"builtin": "tiny", "path": str(tmp_path / "a")}), tmp_path / "cache")


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


def test_a_student_too_big_for_the_host_names_the_key(make_cfg, tmp_path):
    # hardware.host_memory_gib plans on paper: a base (1.4B) student's float32 weights need ~5 GiB
    error = refused_run(make_cfg, tmp_path, "student=base", "hardware.host_memory_gib=1", "data.latent_height=8")
    assert "student ffn_dim=8960: ~5.3 GiB" in error and "1.0 GiB of host memory" in error, error
