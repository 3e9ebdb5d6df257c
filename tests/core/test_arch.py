"""`wandistiller.core.arch`: every named shape is one Wan accepts, a config.json's bad value is one line naming its key,
and the parameter count is arithmetic that matches the model diffusers builds; called directly, no weights."""

from __future__ import annotations

import pytest
import torch

from wandistiller.core.arch import (
    BENCH_ARCHS,
    KNOWN_TEACHERS,
    MAX_ROPE_SEQ_LEN,
    POCKET_TRANSFORMER,
    STUDENT_BUILDERS,
    TINY_I2V_TRANSFORMER,
    TINY_TI2V_TRANSFORMER,
    TINY_TRANSFORMER,
    WAN_1_3B,
    WAN_14B,
    WAN_14B_I2V,
    WAN_TI2V_5B,
    estimate_params,
    json_kind,
    wan_config_problem,
)

# What diffusers' WanTransformer3DModel holds for these shapes (counted on the meta device, 2026-11-26).
BUILT_PARAMS = {"1.3b": 1_418_996_800, "14b": 14_288_491_584}


def test_every_named_shape_passes_the_config_check():
    shapes = [TINY_TRANSFORMER, POCKET_TRANSFORMER, *BENCH_ARCHS.values(), *(c for c, _ in KNOWN_TEACHERS.values())]
    shapes += [TINY_TRANSFORMER | student for student in STUDENT_BUILDERS.values()]  # a student inherits the rest
    assert [wan_config_problem(dict(shape)) for shape in shapes] == [None] * len(shapes)


@pytest.mark.parametrize("change, problem", [
    ({"num_layers": -1}, "num_layers=-1 must be a positive integer"),
    ({"ffn_dim": True}, "ffn_dim=true must be a positive integer"),  # JSON true is a Python int, not a size
    ({"text_dim": "32"}, 'text_dim="32" must be a positive integer'),
    ({"num_attention_heads": None}, "num_attention_heads=null must be a positive integer"),
    ({"out_channels": 0}, "out_channels=0 must be a positive integer"),
    ({"attention_head_dim": 15}, "attention_head_dim=15 must be even and at least 6"),
    ({"attention_head_dim": 4}, "attention_head_dim=4 must be even and at least 6"),
    ({"patch_size": [1, 2]}, "patch_size=[1, 2] must be three positive integers"),
    ({"patch_size": [1, 0, 2]}, "patch_size=[1, 0, 2] must be three positive integers"),
    ({"eps": 0}, "eps=0 must be a positive number"),
    ({"cross_attn_norm": "yes"}, 'cross_attn_norm="yes" must be true or false'),
    ({"qk_norm": "layer_norm"}, "qk_norm=\"layer_norm\" is not one diffusers' Wan applies"),
    ({"rope_max_seq_len": MAX_ROPE_SEQ_LEN + 1}, f"rope_max_seq_len={MAX_ROPE_SEQ_LEN + 1} allocates a table"),
])  # fmt: skip
def test_a_bad_value_is_named_with_its_key(change, problem):
    assert wan_config_problem(dict(TINY_TRANSFORMER) | change).startswith(problem)


def test_optional_keys_may_be_null_or_absent_and_a_non_object_is_named_in_jsons_words():
    assert wan_config_problem(dict(TINY_TRANSFORMER) | {"out_channels": None, "image_dim": None}) is None
    assert wan_config_problem({"num_layers": 2}) is None  # diffusers' defaults fill the rest
    assert wan_config_problem([1, 2]).startswith("holds a JSON array, not an object")
    assert [json_kind(v) for v in ([], "x", None, True, 1, 1.5, {})] == [
        "array", "string", "null", "boolean", "number", "number", "dict"
    ]  # fmt: skip


def test_the_parameter_estimate_is_the_built_models_count_exactly():
    from diffusers import WanTransformer3DModel

    for name, built in BUILT_PARAMS.items():  # the real teachers' counts, as diffusers builds them
        assert estimate_params(BENCH_ARCHS[name]) == built, name
    image_to_video = (TINY_I2V_TRANSFORMER, TINY_I2V_TRANSFORMER | {"pos_embed_seq_len": 8}, TINY_TI2V_TRANSFORMER)
    image_to_video += (WAN_14B_I2V, WAN_TI2V_5B)  # the real Wan 2.1 I2V and TI2V 5B shapes, on the meta device
    for config in (
        TINY_TRANSFORMER,
        TINY_TRANSFORMER | {"cross_attn_norm": False},
        POCKET_TRANSFORMER,
        *image_to_video,
    ):
        with torch.device("meta"):  # shapes only: no memory, no time
            built = sum(p.numel() for p in WanTransformer3DModel(**config).parameters())
        assert estimate_params(config) == built, config
    wider = TINY_TRANSFORMER | {"num_layers": 8}
    assert estimate_params(wider) > estimate_params(TINY_TRANSFORMER)  # blocks add their share
    assert estimate_params(KNOWN_TEACHERS["Wan-AI/Wan2.2-T2V-A14B-Diffusers"][0]) == estimate_params(WAN_14B)
    assert estimate_params(WAN_1_3B) < estimate_params(WAN_14B) / 9
