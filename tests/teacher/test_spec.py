"""`wandistiller.teacher.spec`: diffusers folders inspected, read and resolved (local, built-in, Hub); damaged ones,
components a library cannot load and unreachable Hub ids refused in one line."""

from __future__ import annotations

import json
import logging
import shutil
import struct
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import refused
from wandistiller.core.arch import Layout
from wandistiller.core.errors import UserError
from wandistiller.teacher.spec import inspect_teacher, resolve_teacher_path


@pytest.mark.parametrize(
    "damage,message",
    [
        ("missing", "does not exist"),
        ("empty_dir", "model_index.json is missing"),
        ("pickle_only", "only pickle .bin weights"),
        ("not_wan", "without a WanTransformer3DModel"),
    ],
)
def test_a_folder_that_is_not_a_wan_teacher_is_refused_clearly(tmp_path, tiny_path, damage, message):
    folder = tmp_path / "teacher"
    if damage == "empty_dir":
        folder.mkdir()
    elif damage == "pickle_only":
        shutil.copytree(tiny_path, folder)
        for f in (folder / "transformer").glob("*.safetensors"):
            f.rename(f.with_name("diffusion_pytorch_model.bin"))
    elif damage == "not_wan":
        shutil.copytree(tiny_path, folder)
        index = json.loads((folder / "model_index.json").read_text())
        index["_class_name"], index["transformer"] = "FluxPipeline", ["diffusers", "FluxTransformer2DModel"]
        (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=message) as e:
        inspect_teacher(
            resolve_teacher_path(OmegaConf.create({"builtin": None, "path": str(folder)}), "/nonexistent-cache")
        )
    assert "\n" not in str(e.value)


def test_an_unreachable_hub_id_says_how_to_get_it(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="hf download"):
        resolve_teacher_path(
            OmegaConf.create({"builtin": None, "path": "Wan-AI/Not-A-Real-Model-Diffusers"}), "/nonexistent-cache"
        )


def _damage_component(folder, damage) -> None:
    """One component of a copied tiny teacher made missing, garbage, truncated or bogus."""
    index_file = folder / "model_index.json"
    index = json.loads(index_file.read_text())
    if damage == "no_text_encoder":
        shutil.rmtree(folder / "text_encoder")
    elif damage == "garbage_tokenizer":
        (folder / "tokenizer" / "tokenizer.json").write_text("garbage")
    elif damage == "no_tokenizer":
        shutil.rmtree(folder / "tokenizer")
    elif damage == "truncated_vae":
        weights = next((folder / "vae").glob("*.safetensors"))
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "garbage_vae_config":
        (folder / "vae" / "config.json").write_text("{")
    elif damage in ("bogus_scheduler", "bogus_tokenizer", "os_system"):
        name = {"bogus_scheduler": "scheduler", "bogus_tokenizer": "tokenizer", "os_system": "text_encoder"}[damage]
        index[name] = ["diffusers", "Nonexistent"] if damage != "os_system" else ["os", "system"]
    elif damage == "bom":
        index_file.write_bytes(b"\xef\xbb\xbf" + index_file.read_bytes())
        return
    elif damage in ("fewer_layers", "more_layers"):
        config_file = folder / "transformer" / "config.json"
        config = json.loads(config_file.read_text())
        config["num_layers"] += -1 if damage == "fewer_layers" else 1
        config_file.write_text(json.dumps(config))
    index_file.write_text(json.dumps(index))


@pytest.mark.parametrize(
    "damage,message",
    [
        ("no_text_encoder", "text_encoder holds no weights"),
        ("garbage_tokenizer", "tokenizer.json is not valid JSON"),
        ("no_tokenizer", "tokenizer_config.json is missing"),
        ("truncated_vae", "re-download the teacher"),
        ("garbage_vae_config", "vae/config.json is not valid JSON"),
        ("bogus_scheduler", "'scheduler' is .*Nonexistent.*a Wan folder names a diffusers SchedulerMixin"),
        ("bogus_tokenizer", "'tokenizer' is .*Nonexistent"),
        ("os_system", r"'text_encoder' is \[\"os\", \"system\"\]"),
        ("bom", "model_index.json starts with a byte-order mark"),
        ("fewer_layers", r"num_layers=3 but its weights hold 4 blocks"),
        ("more_layers", r"num_layers=5 but its weights hold 4 blocks"),
    ],
)
def test_every_teacher_component_that_is_missing_garbage_or_bogus_is_one_line(tmp_path, tiny_path, damage, message):
    folder = tmp_path / "teacher"
    shutil.copytree(tiny_path, folder)
    _damage_component(folder, damage)
    with pytest.raises(UserError, match=message) as e:
        inspect_teacher(folder)
    assert "\n" not in str(e.value)


def test_a_component_the_library_cannot_load_is_one_line_naming_it(tmp_path, tiny_path):
    """Valid JSON the tokenizer library still rejects: seen only when it loads, and still one line."""
    from wandistiller.data.prompts import encode_prompts

    folder = tmp_path / "teacher"
    shutil.copytree(tiny_path, folder)
    (folder / "tokenizer" / "tokenizer.json").write_text('{"model": {"type": "Nonsense"}}')
    spec = inspect_teacher(folder)
    with pytest.raises(UserError, match="its text encoder or tokenizer cannot be loaded") as e:
        encode_prompts(spec, ["a fox"], "", 16, torch.float32, torch.device("cpu"), tmp_path / "cache")
    assert "\n" not in str(e.value)


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


def test_a_teacher_path_that_is_a_symlink_loop_is_named_so(tmp_path):
    from omegaconf import OmegaConf

    from wandistiller.teacher.spec import resolve_teacher_path

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with refused("is a symbolic link that leads nowhere"):
        resolve_teacher_path(OmegaConf.create({"builtin": "tiny", "path": str(tmp_path / "a")}), tmp_path / "cache")


def test_a_missing_folder_inside_an_existing_one_is_one_line_not_a_hub_download(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(UserError, match=r"^teacher.path='models/Wan2.1-T2V-1.3B-Diffusers' does not exist; point"):
        resolve_teacher_path(OmegaConf.create({"builtin": None, "path": "models/Wan2.1-T2V-1.3B-Diffusers"}), "/none")
    assert capsys.readouterr().err == ""  # nothing tried on the Hub, nothing logged


def test_an_unreachable_hub_id_is_our_one_line_without_diffusers_own(monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with caplog.at_level(logging.INFO), pytest.raises(UserError, match="could not be fetched from the Hub"):
        resolve_teacher_path(OmegaConf.create({"builtin": None, "path": "Wan-AI/Not-A-Real-Model"}), "/none")
    assert not [r for r in caplog.records if r.name.startswith("diffusers")]  # "Couldn't connect to the Hub" …


@pytest.mark.parametrize(
    "twin,layout,image_encoder,channels,experts",
    [
        ("tiny", Layout.t2v, False, 16, 1),
        ("tiny_i2v", Layout.i2v, True, 16, 1),
        ("tiny_i2v_moe", Layout.i2v, False, 16, 2),
        ("tiny_ti2v", Layout.ti2v, False, 48, 1),
    ],
)
def test_the_layout_is_read_off_the_folders_configs(twin, layout, image_encoder, channels, experts, request, tmp_path):
    # Copied under a name that says nothing: the configs alone decide.
    folder = tmp_path / "some-model"
    shutil.copytree(request.getfixturevalue(f"{twin}_path"), folder)
    spec = inspect_teacher(folder)
    assert (spec.layout, spec.image_encoder, spec.latent_channels, len(spec.experts)) == (
        layout,
        image_encoder,
        channels,
        experts,
    )
    assert spec.boundary_ratio == (0.9 if twin == "tiny_i2v_moe" else None)


def _set_json(file: Path, **changes) -> None:
    file.write_text(json.dumps(json.loads(file.read_text()) | changes))


@pytest.mark.parametrize(
    "twin,damage,message",
    [
        ("tiny_i2v", "in_channels", "neither text-to-video's"),
        ("tiny_i2v", "no_image_encoder", "image_dim=24 wants CLIP image tokens"),
        ("tiny_i2v_moe", "expand_timesteps", "do not agree with expand_timesteps"),
        ("tiny_ti2v", "z_dim", "do not agree with expand_timesteps"),
    ],
)
def test_a_folder_whose_configs_disagree_on_its_layout_is_refused_in_one_line(twin, damage, message, request, tmp_path):
    folder = tmp_path / "teacher"
    shutil.copytree(request.getfixturevalue(f"{twin}_path"), folder)
    if damage == "in_channels":
        _set_json(folder / "transformer" / "config.json", in_channels=20)
    elif damage == "no_image_encoder":
        _set_json(folder / "model_index.json", image_encoder=[None, None], image_processor=[None, None])
    elif damage == "expand_timesteps":
        _set_json(folder / "model_index.json", expand_timesteps=True)
    else:  # a TI2V transformer over a 16-channel VAE
        _set_json(folder / "vae" / "config.json", z_dim=16)
    with pytest.raises(UserError, match=message) as e:
        inspect_teacher(folder)
    assert "\n" not in str(e.value)
