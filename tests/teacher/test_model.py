"""`wandistiller.teacher.model`: the runtime teacher, its experts loaded frozen (from a folder this project did not
write too) and computing guided targets with the CFG scale of each expert."""

from __future__ import annotations

import json

import torch
from omegaconf import OmegaConf

from tests.conftest import FP32
from wandistiller.core.distributed import Topology
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.teacher.model import guidance_scales
from wandistiller.teacher.spec import inspect_teacher, resolve_teacher_path


def scales(scale: float, scale_2: float | None):
    return OmegaConf.create({"guidance_scale": scale, "guidance_scale_2": scale_2, "quantize": None})


def teacher_cfg(**kw):
    return OmegaConf.create({"guidance_scale": 5.0, "guidance_scale_2": None} | kw)


def test_teacher_is_frozen(tiny_path):
    teacher = CpuPlacement().load(inspect_teacher(tiny_path), teacher_cfg(), FP32, Topology())
    expert = teacher.experts[0]
    assert not expert.training and not any(p.requires_grad for p in expert.parameters())


def test_a_wan_folder_this_project_did_not_create_loads(tmp_path):
    """Sharded safetensors, FlowMatchEuler scheduler, bf16 text encoder, model_index written by hand."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from wandistiller.teacher.tiny import TINY_TRANSFORMER, _build_tokenizer

    root = tmp_path / "Wan-external"
    tokenizer = _build_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=32, num_layers=1, num_heads=2, d_kv=16, d_ff=48)).to(
        torch.bfloat16
    ).save_pretrained(root / "text_encoder")
    for i, name in enumerate(["transformer", "transformer_2"]):
        torch.manual_seed(10 + i)
        WanTransformer3DModel(**TINY_TRANSFORMER | {"num_layers": 3}).save_pretrained(
            root / name, max_shard_size="50KB"
        )
    FlowMatchEulerDiscreteScheduler(shift=5.0).save_pretrained(root / "scheduler")
    from wandistiller.teacher.tiny import build_tiny_pipeline

    build_tiny_pipeline().vae.save_pretrained(root / "vae")
    (root / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "WanPipeline",
                "_diffusers_version": "0.35.0",
                "boundary_ratio": 0.9,
                "expand_timesteps": False,
                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                "text_encoder": ["transformers", "UMT5EncoderModel"],
                "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
                "transformer": ["diffusers", "WanTransformer3DModel"],
                "transformer_2": ["diffusers", "WanTransformer3DModel"],
                "vae": ["diffusers", "AutoencoderKLWan"],
            }
        )
    )
    assert (root / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()  # really sharded
    spec = inspect_teacher(
        resolve_teacher_path(OmegaConf.create({"builtin": None, "path": str(root)}), "/nonexistent-cache")
    )
    assert spec.experts == ("transformer", "transformer_2") and spec.flow_shift == 5.0 and spec.boundary_timestep == 900
    teacher = CpuPlacement().load(spec, teacher_cfg(), FP32, Topology())
    assert len(teacher.experts[1].blocks) == 3
    target, _ = teacher.targets(
        torch.randn(2, 16, 1, 8, 8), torch.tensor([950.0, 10.0]), torch.randn(2, 512, 32), torch.zeros(2, 512, 32)
    )
    assert target.shape == (2, 16, 1, 8, 8) and torch.isfinite(target).all()


def test_each_expert_gets_its_scale_and_the_low_noise_expert_falls_back_to_the_main_one(tiny_path, tiny_moe_path):
    one, two = inspect_teacher(tiny_path), inspect_teacher(tiny_moe_path)
    assert guidance_scales(one, scales(5.0, 3.0)) == [5.0]
    assert guidance_scales(two, scales(5.0, 3.0)) == [5.0, 3.0]
    assert guidance_scales(two, scales(5.0, None)) == [5.0, 5.0]
