"""Everything that can be checked from config and files is refused in one line before anything heavy:
student and teacher configs, safetensors headers, trainer values, folders, prompts, the wandb login."""

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
from wandistiller.tracking.loggers import WandbTracker
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


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.optimizer.lr=-1", "trainer.optimizer: Invalid learning rate: -1"),
        ("trainer.optimizer.betas=[2.0,0.9]", "trainer.optimizer: Invalid beta parameter"),
        ("trainer.optimizer.weight_decay=-1", "trainer.optimizer: Invalid weight_decay value"),
        ("trainer.ema_decay=1.0", "trainer.ema_decay=1.0 must be in [0, 1)"),
        ("trainer.ema_decay=-0.1", "trainer.ema_decay=-0.1 must be in [0, 1)"),
        ("trainer.warmup_steps=-1", "trainer.warmup_steps=-1 must be 0 or more"),
        ("teacher.max_sequence_length=0", "teacher.max_sequence_length=0 must be in [1, 4096]"),
        ("trainer.sample_steps=0", "trainer.sample_steps=0 must be a positive integer"),
        ("trainer.val_every=-1", "trainer.val_every=-1 must be 0 or more"),
        ("trainer.sample_every=-1", "trainer.sample_every=-1 must be 0 or more"),
        ("trainer.keep_checkpoints=-1", "trainer.keep_checkpoints=-1 must be 0 or more"),
        ("trainer.sample_prompts=-1", "trainer.sample_prompts=-1 must be 0 or more"),
        ("trainer.max_grad_norm=0", "trainer.max_grad_norm=0.0 must be positive, or null"),
        ("data.val_fraction=1.5", "data.val_fraction=1.5 must be in [0, 1)"),
        ("data.latents_per_prompt=0", "data.latents_per_prompt=0 must be a positive integer"),
        ("data.sample_steps=0", "data.sample_steps=0 must be a positive integer"),
        ("data.latent_chunk=0", "data.latent_chunk=0 must be a positive integer"),
        ("student.hidden_kd_weight=-1", "student.hidden_kd_weight=-1.0 must be 0 or more"),
        ("teacher.flow_shift=0", "teacher.flow_shift=0.0 must be positive"),
        ("teacher.guidance_scale=nan", "teacher.guidance_scale=nan must be a finite number"),
        ("distributed.timeout_min=0", "distributed.timeout_min=0.0 must be positive"),
        ("hardware.host_memory_gib=-5", "hardware.host_memory_gib=-5.0 must be positive, or null"),
    ],
)
def test_trainer_values_out_of_range_are_refused_before_the_run_folder(make_cfg, tmp_path, override, message):
    with refused(message) as e:
        run(make_cfg(override, run_dir=tmp_path / "r"))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


def test_a_student_config_with_negative_layers_is_refused_before_the_run_folder(make_cfg, tmp_path):
    path = tmp_path / "student.json"
    path.write_text(json.dumps(TINY_STUDENT | {"num_layers": -1}))
    with refused("num_layers=-1 must be a positive integer"):
        run(make_cfg("student=from_json", f"student.config_path={path}", run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_folders_that_cannot_be_written_are_named(make_cfg, tmp_path):
    (tmp_path / "afile").write_text("x")
    assert "runs through" in folder_problem(tmp_path / "afile" / "run") and "which is a file" in folder_problem(
        tmp_path / "afile" / "run"
    )
    assert folder_problem(tmp_path / "new" / "deeper") is None
    with refused("hydra.run.dir:") as e:
        run(make_cfg(run_dir=tmp_path / "afile" / "run"))
    assert "runs through" in str(e.value)
    with refused("paths.cache_dir:"):
        run(make_cfg(f"paths.cache_dir={tmp_path / 'afile' / 'cache'}", run_dir=tmp_path / "r"))
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


def test_online_wandb_without_a_login_is_refused_before_the_run_folder(make_cfg, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    with refused("logger.wandb.mode=online: no wandb login for https://api.wandb.ai") as e:
        run(make_cfg("logger=wandb", "logger.wandb.mode=online", run_dir=tmp_path / "r"))
    assert "wandb login" in str(e.value) and not (tmp_path / "r").exists()
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "a" * 40 + "\n")
    (tmp_path / "netrc").chmod(0o600)
    assert WandbTracker.login_problem("online") is None
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_API_KEY", "b" * 40)
    assert WandbTracker.login_problem("online") is None and WandbTracker.login_problem("offline") is None


def test_a_local_teachers_files_are_checked_before_the_planner_reads_its_config(make_cfg, tmp_path, tiny_path):
    folder = tmp_path / "teacher"
    shutil.copytree(tiny_path, folder)
    _edit_json("transformer/config.json", lambda j: j | {"num_layers": "four"})(folder)
    with refused('transformer/config.json: num_layers="four" must be a positive integer'):
        run(make_cfg(f"teacher.path={folder}", run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("override", ["+trainer.bacth_size=2", "+foo=1", "+data.promts_path=x"])
def test_a_key_added_with_plus_that_no_schema_knows_is_refused(make_cfg, tmp_path, override):
    key = override[1:].split("=")[0]
    with refused(f"{key} is not a WanDistiller option"):
        run(make_cfg(override, run_dir=tmp_path / "r"))


def test_a_teacher_path_that_is_a_symlink_loop_is_named_so(tmp_path):
    from omegaconf import OmegaConf

    from wandistiller.teacher.model import resolve_teacher_path

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with refused("is a symbolic link that leads nowhere"):
        resolve_teacher_path(OmegaConf.create({"builtin": "tiny", "path": str(tmp_path / "a")}), tmp_path / "cache")


def test_a_run_refused_after_its_folder_was_claimed_leaves_no_folder_in_process_too(make_cfg, tmp_path):
    with refused("trainer.resume='/no/such/ckpt'"):
        run(make_cfg("trainer.resume=/no/such/ckpt", run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.eval_at_end=true", "hooks=[monitor,progress]"],
         r"^trainer.eval_at_end=true needs the evaluate hook: hooks=\[...,evaluate\] or trainer.eval_at_end=false$"),
        (["+hooks.mine.every=5"], r"^hooks.mine=\{'every': 5\} is not a hook; `hooks` names hooks \(.*evaluate.*\)"),
    ],
)  # fmt: skip
def test_a_hooks_list_that_would_fail_late_is_refused_before_the_run_folder(make_cfg, tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        run(make_cfg(*overrides, run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()
