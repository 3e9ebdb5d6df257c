"""`wandistiller.teacher.tiny`: in-process builds (never saved) against the session's built tiny teachers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wandistiller.core.arch import TINY_MOE_BOUNDARY_RATIO
from wandistiller.core.assets import DEFAULT_PROMPTS
from wandistiller.teacher.tiny import _build_tokenizer, build_pattern, build_tiny_pipeline, ensure_tiny_teacher

UNK, EOS = 2, 1


def same_weights(module: torch.nn.Module, file: Path) -> bool:
    """Whether every tensor saved in `file` is bit for bit the module's (tied copies are saved once)."""
    mine = module.state_dict()
    return all(torch.equal(mine[k], v) for k, v in load_file(str(file)).items())


def test_a_build_in_this_process_has_the_bytes_of_the_cached_folder(tiny_path):
    pipe = build_tiny_pipeline()
    assert same_weights(pipe.transformer, tiny_path / "transformer" / "diffusion_pytorch_model.safetensors")
    assert same_weights(pipe.vae, tiny_path / "vae" / "diffusion_pytorch_model.safetensors")
    assert same_weights(pipe.text_encoder, tiny_path / "text_encoder" / "model.safetensors")
    assert pipe.transformer_2 is None and pipe.config.boundary_ratio is None


def test_the_two_expert_teacher_has_a_second_differently_seeded_expert_and_wan_22s_boundary(tiny_moe_path):
    pipe = build_tiny_pipeline(two_experts=True)
    index = json.loads((tiny_moe_path / "model_index.json").read_text())
    assert index["boundary_ratio"] == pipe.config.boundary_ratio == TINY_MOE_BOUNDARY_RATIO == 0.875
    assert same_weights(pipe.transformer_2, tiny_moe_path / "transformer_2" / "diffusion_pytorch_model.safetensors")
    assert same_weights(pipe.transformer, tiny_moe_path / "transformer" / "diffusion_pytorch_model.safetensors")
    assert not torch.equal(pipe.transformer.proj_out.weight, pipe.transformer_2.proj_out.weight)
    assert index["scheduler"] == ["diffusers", "UniPCMultistepScheduler"]
    assert pipe.scheduler.config.flow_shift == 3.0 and pipe.scheduler.config.prediction_type == "flow_prediction"


def test_a_real_shaped_transformer_config_stores_bf16_weights_with_fp32_norms_and_a_text_encoder_that_fits():
    pipe = build_tiny_pipeline(transformer_config={"text_dim": 48, "num_layers": 1})
    assert pipe.text_encoder.config.d_model == 48 and pipe.transformer.config.num_layers == 1
    dtypes = {name: p.dtype for name, p in pipe.transformer.named_parameters()}
    assert dtypes["proj_out.weight"] == torch.bfloat16
    assert dtypes["blocks.0.norm2.weight"] == torch.float32  # Wan's norms stay fp32, as from_pretrained leaves them
    assert pipe.vae.dtype == torch.float32


def test_the_tokenizer_knows_every_word_of_the_default_prompts_and_ends_each_with_eos():
    tokenizer = _build_tokenizer()
    prompts = DEFAULT_PROMPTS.read_text().splitlines()
    ids = [tokenizer(p).input_ids for p in prompts]
    assert all(row[-1] == EOS and UNK not in row for row in ids)
    assert tokenizer("A RED FOX").input_ids == tokenizer("a red fox").input_ids  # lower-cased first
    assert tokenizer("a zebracorn").input_ids[-2:] == [UNK, EOS]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, EOS, UNK)


def test_a_folder_that_already_has_its_model_index_is_returned_without_building(tmp_path):
    folder = tmp_path / "teachers" / "tiny-wan-t2v"
    folder.mkdir(parents=True)
    (folder / "model_index.json").write_text("{}")
    assert ensure_tiny_teacher(folder) == folder
    assert [p.name for p in folder.iterdir()] == ["model_index.json"]  # nothing built into it
    assert [p.name for p in folder.parent.iterdir()] == ["tiny-wan-t2v"]  # and no build folder beside it


def test_the_build_folder_pattern_matches_only_this_teachers_temporary_folders():
    pattern = build_pattern(Path("/cache/teachers/tiny-wan-t2v.v2"))
    assert re.match(pattern, ".tiny-wan-t2v.v2.build-host-123")
    assert not re.match(pattern, ".tiny-wan-t2vXv2.build-host-123")  # the dot is a dot, not any character
    assert not re.match(pattern, ".tiny-wan-t2v.build-host-123")  # another teacher's


def test_a_tiny_teacher_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path):
    """A full disk (here a file-size limit: the same OSError from every write) while the tiny teacher is built."""
    import resource
    import signal

    from wandistiller.core.errors import UserError

    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, before[1]))
    try:
        with pytest.raises(UserError, match=r"^teacher.path=.*: the tiny teacher cannot be built there \(File too"):
            ensure_tiny_teacher(tmp_path / "teachers" / "tiny-wan-t2v")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before)
        signal.signal(signal.SIGXFSZ, handler)
    assert list((tmp_path / "teachers").iterdir()) == []


def test_the_image_to_video_twins_are_laid_out_as_the_hubs_folders_of_their_layout(
    tiny_i2v_path, tiny_i2v_moe_path, tiny_ti2v_path
):
    def index(path):
        return json.loads((path / "model_index.json").read_text())

    def config(path, name):
        return json.loads((path / name / "config.json").read_text())

    # Wan 2.1 I2V: 36 channels in (noise, mask, image latents), CLIP image tokens projected to the blocks' width.
    wan21 = index(tiny_i2v_path)
    assert wan21["_class_name"] == "WanImageToVideoPipeline" and wan21["image_encoder"][1] == "CLIPVisionModel"
    transformer = config(tiny_i2v_path, "transformer")
    assert (transformer["in_channels"], transformer["out_channels"]) == (36, 16)
    assert transformer["image_dim"] == config(tiny_i2v_path, "image_encoder")["hidden_size"]
    assert transformer["added_kv_proj_dim"] == transformer["num_attention_heads"] * transformer["attention_head_dim"]
    # Wan 2.2 I2V A14B: the same channels, no image encoder, two differently seeded experts split at t = 900.
    a14b = index(tiny_i2v_moe_path)
    assert a14b["image_encoder"] == [None, None] and a14b["boundary_ratio"] == 0.9
    assert config(tiny_i2v_moe_path, "transformer_2")["in_channels"] == 36
    assert config(tiny_i2v_moe_path, "transformer").get("image_dim") is None
    # Wan 2.2 TI2V 5B: a text-to-video pipeline folder with expand_timesteps, over a 48-channel Wan 2.2 VAE.
    ti2v = index(tiny_ti2v_path)
    assert ti2v["_class_name"] == "WanPipeline" and ti2v["expand_timesteps"] is True
    vae = config(tiny_ti2v_path, "vae")
    assert (vae["z_dim"], vae["patch_size"], vae["scale_factor_spatial"], vae["is_residual"]) == (48, 2, 16, True)
    assert config(tiny_ti2v_path, "transformer")["in_channels"] == 48 == len(vae["latents_mean"])
