"""wandistiller/state/loralayout.py: adapters in the Lightning layout, named by singlefile's diffusers->Wan map; what
diffusers' own Wan LoRA converter reads back as the same layers at the same scale; sizes from shapes alone."""

from __future__ import annotations

import pytest
import torch

from wandistiller.state.loralayout import adapter_rank, lightning_name, lightning_tensors, lora_bytes, metadata
from wandistiller.teacher.lora import TARGETS, layer_widths

WAN = {
    "attn1.to_q": "self_attn.q",
    "attn1.to_k": "self_attn.k",
    "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q",
    "attn2.to_k": "cross_attn.k",
    "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}
CONFIG = {"num_attention_heads": 2, "attention_head_dim": 8, "ffn_dim": 24}


def peft_state(rank: int, blocks: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(blocks):
        for name, (n_in, n_out) in layer_widths(CONFIG).items():
            state[f"blocks.{i}.{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=g)
            state[f"blocks.{i}.{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=g)
    return state


def test_every_adapted_layer_has_the_wan_reference_name():
    assert set(WAN) == set(TARGETS)
    for ours, wan in WAN.items():
        assert lightning_name(f"blocks.7.{ours}") == f"diffusion_model.blocks.7.{wan}"
    # Wan 2.1 I2V's image keys have Wan's names (cross_attn.k_img); a module Wan's layout lacks has none.
    assert lightning_name("blocks.0.attn2.add_k_proj") == "diffusion_model.blocks.0.cross_attn.k_img"
    with pytest.raises(ValueError, match="no name in the Wan reference layout"):
        lightning_name("blocks.0.attn1.to_x")


def test_diffusers_own_converter_reads_back_the_same_layers_at_the_same_scale():
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers

    state, rank, alpha = peft_state(3), 3, 6.0
    tensors = lightning_tensors(state, alpha, "fp32")
    assert len(tensors) == 3 * len(state) // 2 and tensors["diffusion_model.blocks.1.ffn.2.alpha"].ndim == 0
    back = {k.removeprefix("transformer."): v for k, v in _convert_non_diffusers_wan_lora_to_diffusers(tensors).items()}
    assert set(back) == set(state)
    for key in [k for k in state if k.endswith("lora_A.weight")]:
        up = key.replace("lora_A", "lora_B")
        # diffusers folds alpha / rank into the halves (and loads them at scale 1): the product is the student's
        assert torch.allclose(back[up] @ back[key], (alpha / rank) * state[up] @ state[key], atol=1e-6), key
    assert adapter_rank(state) == rank
    bf16 = lightning_tensors(state, alpha, "bf16")
    assert bf16["diffusion_model.blocks.0.self_attn.q.lora_up.weight"].dtype == torch.bfloat16
    assert bf16["diffusion_model.blocks.0.self_attn.q.alpha"].dtype == torch.float32


def test_bad_adapters_and_dtypes_are_refused():
    state = peft_state(2, 1)
    with pytest.raises(ValueError, match="not a LoRA adapter of a Wan block"):
        lightning_tensors(state | {"proj_out.lora_A.weight": torch.zeros(2, 16)}, 2.0, "fp32")
    with pytest.raises(ValueError, match="one half of an adapter"):
        lightning_tensors({k: v for k, v in state.items() if "to_q.lora_B" not in k}, 2.0, "fp32")
    with pytest.raises(ValueError, match="not one of bf16, fp16, fp32"):
        lightning_tensors(state, 2.0, "fp8")
    with pytest.raises(ValueError, match="ranks"):
        adapter_rank(state | {"blocks.1.attn1.to_q.lora_A.weight": torch.zeros(3, 16)})


def test_the_size_from_shapes_is_the_tensors_bytes_and_the_metadata_is_strings():
    state = peft_state(4, 3)
    for dtype in ("bf16", "fp32"):
        tensors = lightning_tensors(state, 4.0, dtype)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert lora_bytes(layer_widths(CONFIG).values(), 3, 4, dtype) == size
    meta = metadata(4, 4.0, {"steps": 4}, {"name": "t"}, {"expert": "low_noise"})
    assert all(isinstance(v, str) for v in meta.values()) and meta["ss_network_dim"] == "4"
