"""Single files in the Wan reference layout, checked by diffusers' own single-file loader and converter."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from wandistiller.core.assets import ASSETS
from wandistiller.state.singlefile import (
    SCALED_FP8,
    block_count_problem,
    config_of,
    dequantized,
    expert_names,
    file_bytes,
    loader_assumptions_broken,
    metadata,
    quantize_tensorwise,
    wan_key,
    wan_tensors,
)

POCKET = ASSETS / "pocket" / "pocket-wan-t2v"


@pytest.fixture(scope="module")
def pocket_student():
    """A pocket student as `student=half` starts: the pocket teacher's trained weights at half its blocks."""
    from diffusers import WanTransformer3DModel

    teacher = WanTransformer3DModel.from_pretrained(POCKET / "transformer", torch_dtype=torch.float32)
    config = config_of(teacher) | {"num_layers": teacher.config.num_layers // 2}
    student = WanTransformer3DModel.from_config(config)
    state = {k: v for k, v in teacher.state_dict().items() if not k.startswith("blocks.")}
    for i in range(config["num_layers"]):  # every other block, as a pruned student keeps them, renumbered
        j = 2 * i
        state |= {
            f"blocks.{i}.{k[len(f'blocks.{j}.') :]}": v
            for k, v in teacher.state_dict().items()
            if k.startswith(f"blocks.{j}.")
        }
    student.load_state_dict(state)
    return student.eval().requires_grad_(False)


def inputs(model) -> dict:
    g = torch.Generator().manual_seed(0)
    c = model.config
    return {
        "hidden_states": torch.randn(2, c.in_channels, 1, 8, 8, generator=g),
        "timestep": torch.tensor([900.0, 300.0]),
        "encoder_hidden_states": torch.randn(2, 16, c.text_dim, generator=g),
        "return_dict": False,
    }


def output(model, dtype=torch.float32) -> torch.Tensor:
    with torch.no_grad():
        return model.to(dtype)(
            **{k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs(model).items()}
        )[0].float()


def written(model, dtype: str, folder, name="student"):
    import json

    tensors = wan_tensors(model, dtype)
    save_file(tensors, str(folder / f"{name}.safetensors"), metadata=metadata(config_of(model), {"steps": 4}, {}))
    (folder / "config.json").write_text(json.dumps(config_of(model)))
    return folder / f"{name}.safetensors"


def test_the_layout_is_wan_s_and_diffusers_own_converter_gives_back_every_tensor(pocket_student):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    tensors = wan_tensors(pocket_student, "fp32")
    for key in (
        "patch_embedding.weight",
        "text_embedding.0.weight",
        "text_embedding.2.bias",
        "time_embedding.0.weight",
        "time_projection.1.weight",
        "blocks.0.self_attn.q.weight",
        "blocks.0.self_attn.o.bias",
        "blocks.0.self_attn.norm_q.weight",
        "blocks.0.cross_attn.k.weight",
        "blocks.0.cross_attn.norm_k.weight",
        "blocks.1.norm3.weight",
        "blocks.1.ffn.0.weight",
        "blocks.1.ffn.2.bias",
        "blocks.1.modulation",
        "head.head.weight",
        "head.modulation",
    ):
        assert key in tensors, key
    assert block_count_problem(tensors) is None and block_count_problem(["blocks.0.x", "blocks.2.x"])
    back = convert_wan_transformer_to_diffusers(dict(tensors))
    state = pocket_student.state_dict()
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    with pytest.raises(ValueError, match="no name in the Wan reference layout"):
        wan_key("condition_embedder.image_embedder.pos_embed")  # FLF2V's: no model here has it


def test_a_wan21_i2v_transformer_round_trips_through_the_reference_layout_diffusers_reads(tiny_i2v_path):
    """Issue 42: Wan 2.1 I2V's CLIP image parts (img_emb, each block's k_img / v_img / norm_k_img) named as Wan's
    own files name them, which diffusers' converter reads back to the same tensors."""
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    model = WanTransformer3DModel.from_pretrained(tiny_i2v_path, subfolder="transformer")
    tensors = {wan_key(k): v for k, v in model.state_dict().items()}
    assert {
        "img_emb.proj.1.weight",
        "blocks.0.cross_attn.k_img.weight",
        "blocks.3.cross_attn.norm_k_img.weight",
    } <= set(tensors)
    back = convert_wan_transformer_to_diffusers(dict(tensors))
    state = model.state_dict()
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_diffusers_from_single_file_gives_the_students_output_fp32_exact_bf16_to_rounding(pocket_student, tmp_path):
    from diffusers import WanTransformer3DModel

    reference = output(pocket_student)
    loaded = WanTransformer3DModel.from_single_file(
        str(written(pocket_student, "fp32", tmp_path)), config=str(tmp_path)
    )
    assert torch.equal(output(loaded), reference)
    with safe_open(str(tmp_path / "student.safetensors"), "pt") as f:
        assert f.metadata()["config"] and '"steps": 4' in f.metadata()["sampling"]
    (tmp_path / "bf16").mkdir()
    file = written(pocket_student, "bf16", tmp_path / "bf16")
    assert load_file(str(file))["blocks.0.self_attn.q.weight"].dtype == torch.bfloat16
    assert load_file(str(file))["blocks.0.modulation"].dtype == torch.float32  # diffusers keeps it fp32
    loaded = WanTransformer3DModel.from_single_file(
        str(file), config=str(tmp_path / "bf16"), torch_dtype=torch.bfloat16
    )
    bf16 = output(loaded, torch.bfloat16)
    assert ((bf16 - reference).norm() / reference.norm()).item() < 1e-2
    assert file.stat().st_size - file_bytes(pocket_student, "bf16") < 20_000  # the header: JSON of names and shapes


def test_fp8_is_comfyuis_per_layer_layout_agrees_with_the_projects_fp8_and_stays_within_1_percent(
    pocket_student, tmp_path
):
    from diffusers import WanTransformer3DModel

    from wandistiller.teacher.fp8 import quantize_weight, relative_mse

    tensors = wan_tensors(pocket_student, "fp8")  # ComfyUI's per-layer `.comfy_quant` layout
    legacy = wan_tensors(pocket_student, "fp8", "scaled_fp8")
    assert SCALED_FP8 not in tensors and not any(k.endswith(".scale_weight") for k in tensors)
    assert legacy[SCALED_FP8].dtype == torch.float8_e4m3fn and legacy[SCALED_FP8].numel() == 0
    for key in ("blocks.0.self_attn.q", "blocks.0.cross_attn.o", "blocks.1.ffn.0", "blocks.1.ffn.2"):
        weight, scale = tensors[f"{key}.weight"], tensors[f"{key}.weight_scale"]
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == ()
        config = tensors[f"{key}.comfy_quant"]
        assert config.dtype == torch.uint8 and json.loads(config.numpy().tobytes()) == {"format": "float8_e4m3fn"}
        assert torch.equal(legacy[f"{key}.weight"].view(torch.uint8), weight.view(torch.uint8))
        assert torch.equal(legacy[f"{key}.scale_weight"], scale) and f"{key}.comfy_quant" not in legacy
        # The project's fp8 (one scale per row) and the file (one per tensor): the file's scale is the largest row
        # scale, and the row that sets it has the same fp8 bytes in both.
        diffusers_key = {
            "self_attn.q": "attn1.to_q",
            "cross_attn.o": "attn2.to_out.0",
            "ffn.0": "ffn.net.0.proj",
            "ffn.2": "ffn.net.2",
        }[key.split(".", 2)[2]]
        original = pocket_student.state_dict()[f"blocks.{key.split('.')[1]}.{diffusers_key}.weight"]
        rows, row_scales = quantize_weight(original)
        top = int(row_scales.argmax())
        assert scale == row_scales.max() and torch.equal(weight[top].view(torch.uint8), rows[top].view(torch.uint8))
    for key in (
        "patch_embedding.weight",
        "text_embedding.0.weight",
        "head.head.weight",
        "blocks.0.norm3.weight",
        "blocks.0.self_attn.norm_q.weight",
        "blocks.0.modulation",
        "head.modulation",
    ):
        assert tensors[key].dtype in (torch.bfloat16, torch.float32), key
    assert dequantized(legacy).keys() == dequantized(tensors).keys()
    save_file(dequantized(tensors), str(tmp_path / "dequantized.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config_of(pocket_student)))
    fp8 = WanTransformer3DModel.from_single_file(str(tmp_path / "dequantized.safetensors"), config=str(tmp_path))
    bf16 = WanTransformer3DModel.from_config(config_of(pocket_student))
    bf16.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in pocket_student.state_dict().items()})
    assert relative_mse(output(fp8, torch.bfloat16), output(bf16, torch.bfloat16)) <= 0.01
    assert quantize_tensorwise(torch.zeros(3, 4))[1] > 0  # an all-zero weight: zeros, not NaN


def test_an_a14b_pair_loads_as_transformer_and_transformer_2_and_samples_as_the_teacher(tmp_path):
    import json

    from diffusers import WanPipeline, WanTransformer3DModel

    folder = ASSETS / "pocket" / "pocket-wan-t2v-moe"
    pipe = WanPipeline.from_pretrained(folder)
    names = expert_names("pocket", 2)
    assert names == ["pocket_high_noise.safetensors", "pocket_low_noise.safetensors"]
    experts = []
    for model, name in zip((pipe.transformer, pipe.transformer_2), names):
        save_file(wan_tensors(model, "fp32"), str(tmp_path / name))
        experts.append(WanTransformer3DModel.from_single_file(str(tmp_path / name), config=str(folder / "transformer")))
    loaded = WanPipeline.from_pretrained(folder, transformer=experts[0], transformer_2=experts[1])
    boundary = json.loads((folder / "model_index.json").read_text())["boundary_ratio"]
    assert loaded.config.boundary_ratio == boundary

    def sample(p):
        return p(
            "a red 3",
            num_frames=1,
            height=32,
            width=32,
            num_inference_steps=4,
            guidance_scale=3.0,
            max_sequence_length=16,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        ).frames

    assert torch.equal(sample(loaded), sample(pipe))


def test_loader_guesses_a_student_breaks_are_named_and_a_wan_shaped_one_breaks_none(pocket_student):
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    from wandistiller.core.arch import WAN_1_3B

    broken = loader_assumptions_broken(config_of(pocket_student), wan_tensors(pocket_student, "fp32"))
    assert "attention_head_dim=16, not 128" in broken and "text_dim=32, not 4096" in broken
    with init_empty_weights():
        wan = WanTransformer3DModel.from_config(WAN_1_3B)
    tensors = {wan_key(k): v for k, v in wan.state_dict().items()}
    assert loader_assumptions_broken(config_of(wan), tensors) == []
    assert file_bytes(wan, "fp8") < 0.55 * file_bytes(wan, "bf16") < 0.3 * file_bytes(wan, "fp32")
    tensors["blocks.3.ffn.0.weight"] = torch.empty(5, 1, device="meta")
    assert any("FFN widths" in b for b in loader_assumptions_broken(config_of(wan), tensors))
