"""Architecture constants: the one home of every WanTransformer3DModel shape the project names.

The public Wan teachers (so the planner needs no download), the embedded tiny teacher, the named
students and the benchmark shapes all read their numbers from here.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any, TypeGuard


class Layout(str, Enum):
    """What a Wan transformer is fed besides the text, as its own diffusers pipeline feeds it (spec.py reads it
    off a folder's configs)."""

    t2v = "t2v"  # the noisy latents alone (WanPipeline)
    i2v = "i2v"  # + a 4-channel first-frame mask and the image's latents, concatenated (WanImageToVideoPipeline)
    ti2v = "ti2v"  # the image's latent in place of the first latent frame, timesteps per token (expand_timesteps)

    def __str__(self) -> str:
        return self.value


# Wan 2.1/2.2 14B: also each of Wan 2.2 A14B's two experts.
WAN_14B: dict[str, Any] = dict(
    num_attention_heads=40,
    attention_head_dim=128,
    ffn_dim=13824,
    num_layers=40,
    text_dim=4096,
    in_channels=16,
    out_channels=16,
    patch_size=[1, 2, 2],
    freq_dim=256,
)
WAN_1_3B: dict[str, Any] = WAN_14B | dict(num_attention_heads=12, ffn_dim=8960, num_layers=30)

# Image-to-video 14B: the noise, a 4-channel first-frame mask and the image's 16 latent channels, concatenated
# (36 in, 16 out). Wan 2.1's also attends to CLIP ViT-H/14 image tokens (1280 wide, projected to the blocks' 5120);
# Wan 2.2 A14B's two experts have no image encoder.
WAN_14B_I2V: dict[str, Any] = WAN_14B | dict(in_channels=36, image_dim=1280, added_kv_proj_dim=5120)
WAN_A14B_I2V: dict[str, Any] = WAN_14B | dict(in_channels=36)
# Wan 2.2 TI2V 5B: its own 48-channel VAE (16x spatial); the image's latent replaces the first latent frame.
WAN_TI2V_5B: dict[str, Any] = WAN_14B | dict(
    num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48
)

# Public teachers by Hub id: (transformer config, number of experts).
KNOWN_TEACHERS = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": (WAN_1_3B, 1),
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": (WAN_14B, 1),
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": (WAN_14B, 2),
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": (WAN_14B_I2V, 1),
    "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers": (WAN_14B_I2V, 1),
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": (WAN_A14B_I2V, 2),
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": (WAN_TI2V_5B, 1),
}

# The embedded tiny teacher: shaped like Wan (patch (1,2,2), 16 latent channels, qk rms-norm), every width tiny.
TINY_TRANSFORMER: dict[str, Any] = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=16,
    out_channels=16,
    text_dim=32,
    freq_dim=64,
    ffn_dim=64,
    num_layers=4,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)
TINY_TEXT_ENCODER: dict[str, Any] = dict(
    d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8
)
TINY_VAE: dict[str, Any] = dict(
    base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
)
# Wan 2.2 A14B switches experts at t >= 875 (boundary_ratio 0.875 of 1000 train timesteps).
TINY_MOE_BOUNDARY_RATIO = 0.875

# The tiny image-to-video twins, one per layout diffusers' pipelines know (teacher/tiny.py builds them):
# Wan 2.1 I2V's (mask + image latents concatenated, CLIP image tokens), Wan 2.2 I2V A14B's (the same, two experts, no
# image encoder) and Wan 2.2 TI2V 5B's (a 48-channel VAE; the image's latent replaces the first latent frame).
TINY_I2V_TRANSFORMER: dict[str, Any] = TINY_TRANSFORMER | dict(in_channels=36, image_dim=24, added_kv_proj_dim=32)
TINY_I2V_MOE_TRANSFORMER: dict[str, Any] = TINY_TRANSFORMER | dict(in_channels=36)
TINY_TI2V_TRANSFORMER: dict[str, Any] = TINY_TRANSFORMER | dict(in_channels=48, out_channels=48)
# A CLIP vision tower as Wan 2.1 I2V's (whose penultimate hidden states are the image tokens), every width tiny.
TINY_IMAGE_ENCODER: dict[str, Any] = dict(
    hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
)
# Wan 2.2's VAE: 48 latent channels, pixels folded 2x2 into 12 channels first (patch_size 2), 16x spatial overall.
TINY_VAE_22: dict[str, Any] = dict(
    base_dim=8,
    decoder_base_dim=8,
    z_dim=48,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    # Not Wan 2.1's 16 defaults: 48 of them, uneven, so a test sees a normalisation left out.
    latents_mean=[round(0.02 * (i % 7) - 0.06, 2) for i in range(48)],
    latents_std=[round(0.5 + 0.1 * (i % 5), 2) for i in range(48)],
)
# Wan 2.2 I2V A14B switches experts at t >= 900 (its model_index.json's boundary_ratio), not T2V's 875.
TINY_I2V_MOE_BOUNDARY_RATIO = 0.9

# The pocket teacher (wandistiller/pocket): trained on 32x32 digit images; its VAE downsamples 4x (8x8 latents,
# 16 tokens); three times the tiny teacher's width. Width 64 (ffn 256) drew the digit right 51% of the time
# and width 96 99% (2400 steps, CFG 3; flow shift 1 instead of Wan's 3 did worse: 19% / 70%).
POCKET_TRANSFORMER: dict[str, Any] = TINY_TRANSFORMER | dict(num_attention_heads=6, ffn_dim=384)
POCKET_VAE = dict(
    base_dim=8,
    z_dim=16,
    dim_mult=[1, 2, 2],
    num_res_blocks=1,
    temperal_downsample=[False, True],
    scale_factor_spatial=4,
)
POCKET_TEXT_ENCODER = TINY_TEXT_ENCODER
POCKET_MAX_SEQUENCE_LENGTH = 16  # its prompts are 4 tokens; trained at this padding (teacher.max_sequence_length)

# Named students (student.builder); what must match the teacher is inherited from it.
STUDENT_BUILDERS: dict[str, dict] = {
    # 2 blocks at the tiny teacher's width (so it can start from the teacher's blocks).
    "tiny": dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=2),
    # ~0.2B parameters: width 1536, 6 blocks.
    "small": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=4096, num_layers=6),
    # Wan 2.1 1.3B's shape.
    "base": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30),
}

# Named students shaped from the teacher: its widths (so they start from its blocks, as BK-SDM's students do)
# and this share of its blocks.
TEACHER_SHAPED_STUDENTS: dict[str, float] = {"half": 0.5}
# Named students cut from the teacher (wandistiller/student/prune.py): its head size, at no more than this share
# of its transformer's parameters (estimate_params), fewer blocks and fewer heads and FFN channels.
PRUNED_STUDENTS: dict[str, float] = {"quarter": 0.25, "tenth": 0.10}

# Teacher shapes the benchmarks build with random weights.
BENCH_ARCHS: dict[str, dict[str, Any]] = {
    "tiny": dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=4, text_dim=32, freq_dim=64),
    "1.3b": WAN_1_3B,
    "14b": WAN_14B,
}

# WanTransformer3DModel options a config file may set, by the kind of value each must hold.
_POSITIVE_INTS = (
    "num_attention_heads",
    "attention_head_dim",
    "in_channels",
    "text_dim",
    "freq_dim",
    "ffn_dim",
    "num_layers",
    "rope_max_seq_len",
)
_OPTIONAL_POSITIVE_INTS = ("out_channels", "image_dim", "added_kv_proj_dim", "pos_embed_seq_len")


def wan_config_problem(config: object) -> str | None:
    """What is wrong with a WanTransformer3DModel config (a config.json body), in words; None if nothing.

    Checked from JSON before any weights load: diffusers builds whatever it is given (num_layers=-1 is a
    model with no blocks), so a wrong value would otherwise train nonsense or fail deep inside a worker.
    """
    if not isinstance(config, dict):
        return f"holds a JSON {json_kind(config)}, not an object of WanTransformer3DModel options"
    for key in _POSITIVE_INTS + _OPTIONAL_POSITIVE_INTS:
        value = config.get(key)
        if value is None and (key in _OPTIONAL_POSITIVE_INTS or key not in config):
            continue
        if not _is_int(value) or value <= 0:
            return f"{key}={json_repr(value)} must be a positive integer"
    head_dim = config.get("attention_head_dim")
    # Wan's rope splits each head into time/height/width parts of 2*(d//6) channels each, all even.
    if head_dim is not None and (head_dim % 2 or head_dim < 6):
        return f"attention_head_dim={head_dim} must be even and at least 6 (Wan's 3-axis rope splits it)"
    patch = config.get("patch_size")
    if patch is not None and not (
        isinstance(patch, (list, tuple)) and len(patch) == 3 and all(_is_int(p) and p > 0 for p in patch)
    ):
        return f"patch_size={json_repr(patch)} must be three positive integers, e.g. [1, 2, 2]"
    eps = config.get("eps")
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0):
        return f"eps={json_repr(eps)} must be a positive number"
    for key in ("cross_attn_norm",):
        if key in config and not isinstance(config[key], bool):
            return f"{key}={json_repr(config[key])} must be true or false"
    if "qk_norm" in config and config["qk_norm"] not in QK_NORMS:
        # diffusers' Wan blocks always apply rms_norm_across_heads, whatever this says: another value trains silently
        return f"qk_norm={json_repr(config['qk_norm'])} is not one diffusers' Wan applies; use {QK_NORMS[0]!r}"
    rope = config.get("rope_max_seq_len")
    if rope is not None and rope > MAX_ROPE_SEQ_LEN:
        return f"rope_max_seq_len={rope} allocates a table that large; use at most {MAX_ROPE_SEQ_LEN} (Wan uses 1024)"
    return None


QK_NORMS = ("rms_norm_across_heads",)
MAX_ROPE_SEQ_LEN = 65536  # positions per axis; Wan uses 1024 (the rope tables are max_seq_len x head_dim floats)
ROPE_POSITIONS = 1024  # diffusers' WanTransformer3DModel rope_max_seq_len where a config leaves it out


def rope_table(student: dict, teacher: dict) -> tuple[str, int]:
    """(whose, rope_max_seq_len) of the smaller of the student's and the teacher's rope tables: the positions per axis
    a run's latent grid may span (in the student's patches). The teacher's on a tie: a table the student shares (a
    LoRA student is the teacher; a cut one inherits it) is the teacher's limit, which no student setting lifts."""
    tables = [
        (int(c.get("rope_max_seq_len", ROPE_POSITIONS)), who) for who, c in (("teacher", teacher), ("student", student))
    ]
    rope, who = min(tables, key=lambda t: t[0])
    return who, rope


def estimate_params(c: dict) -> int:
    """WanTransformer3DModel's parameter count, by arithmetic (no module built: a huge config takes no time);
    exact for text- and image-to-video configs (tests/core/test_arch.py compares it with the model diffusers
    builds)."""
    d, f, t = c["num_attention_heads"] * c["attention_head_dim"], c["ffn_dim"], c["text_dim"]
    p = 1
    for x in c.get("patch_size") or (1, 2, 2):
        p *= x
    # A block: two attentions' q, k, v, out (weights and biases) and q/k norms, the feed-forward, its modulation
    # table (6d) and the cross-attention norm (weight and bias; diffusers builds it unless told not to).
    block = 8 * d * d + 8 * d + 4 * d + 2 * d * f + f + d + 6 * d + (2 * d if c.get("cross_attn_norm", True) else 0)
    patch_in = c["in_channels"] * p * d + d
    # The condition embedder: text (t->d->d), time (freq->d->d) and its projection to the blocks' 6 modulations.
    conditions = t * d + d + d * d + d + c["freq_dim"] * d + d + d * d + d + 6 * d * d + 6 * d
    out = c.get("out_channels") or c["in_channels"]
    patch_out = d * out * p + out * p + 2 * d  # and the output modulation table
    image, added = c.get("image_dim"), c.get("added_kv_proj_dim")
    if added:  # Wan 2.1 I2V: each block's keys and values of the image tokens, and their q/k-norm
        block += 2 * (added * d + d) + d
    if image:  # and the image tokens' embedder: a norm, a two-layer MLP to the blocks' width, a norm
        conditions += 2 * image + image * image + image + image * d + d + 2 * d
        conditions += (c.get("pos_embed_seq_len") or 0) * image  # FLF2V's learned positions
    return c["num_layers"] * block + patch_in + conditions + patch_out


def json_kind(value: object) -> str:
    """What a JSON value is, in JSON's words (a list is an array, None is null)."""
    kinds = {list: "array", str: "string", type(None): "null", bool: "boolean", int: "number", float: "number"}
    return kinds.get(type(value), type(value).__name__)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is a Python int: not a size


def json_repr(value: object) -> str:

    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
