"""A LoRA student's adapters in the Lightning layout: what ComfyUI's LoraLoader and most published Wan LoRAs use,
and what diffusers' `WanPipeline.load_lora_weights` converts on loading (`_convert_non_diffusers_wan_lora_to_diffusers`
in diffusers/loaders/lora_conversion_utils.py, which it picks for keys starting `diffusion_model.`).

Per adapted Linear of the Wan reference layout (`blocks.N.self_attn.{q,k,v,o}`, `cross_attn.{q,k,v,o}`,
`ffn.{0,2}`: the names state/singlefile.py's `wan_key` gives, the one diffusers->Wan map), three tensors:

    diffusion_model.blocks.N.self_attn.q.lora_down.weight   [rank, in]   peft's lora_A
    diffusion_model.blocks.N.self_attn.q.lora_up.weight     [out, rank]  peft's lora_B
    diffusion_model.blocks.N.self_attn.q.alpha              0-dim float32, the adapter's alpha

The layer adds `(alpha / rank) up @ down @ x`, exactly as the student's adapters (teacher/lora.py): the tensors are
the student's own, renamed and cast. One file per expert; Wan 2.2 A14B's pair is `<name>_high_noise` /
`<name>_low_noise` (singlefile.expert_names), as the single files are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

import torch

from wandistiller.state.singlefile import DTYPES, wan_key

PREFIX = "diffusion_model."
# A key of the student's adapters as diffusers saves them (peft's names, the `transformer.` prefix removed).
PEFT_KEY = re.compile(r"(blocks\.\d+\.[\w.]+)\.lora_([AB])\.weight")
LORA_DTYPES = ("bf16", "fp16", "fp32")  # fp8 adapters: no loader reads them (and they are small already)


def lightning_name(module: str) -> str:
    """`blocks.3.attn1.to_q` -> `diffusion_model.blocks.3.self_attn.q` (ValueError for a module the Wan reference
    layout has no name for)."""
    return PREFIX + wan_key(f"{module}.weight").removesuffix(".weight")


def lightning_tensors(state: dict[str, torch.Tensor], alpha: float, dtype: str) -> dict[str, torch.Tensor]:
    """The adapters `state` (peft keys: `blocks.0.attn1.to_q.lora_A.weight`) in the Lightning layout, in `dtype`,
    each layer with its `alpha`. ValueError for a key that is not an adapter of a Wan block, or a layer without
    both halves."""
    if dtype not in LORA_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(LORA_DTYPES)}")
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        found = PEFT_KEY.fullmatch(key)
        if not found:
            raise ValueError(f"{key!r} is not a LoRA adapter of a Wan block")
        name = lightning_name(found[1])
        half = "lora_down" if found[2] == "A" else "lora_up"
        # a copy, never the student's own tensor: diffusers' converter scales the cross-attention and FFN halves
        # in place (`*=`), which would change the student's adapters under a caller holding both
        out[f"{name}.{half}.weight"] = tensor.detach().to(DTYPES[dtype], copy=True).contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
    for alpha_key in [k for k in out if k.endswith(".alpha")]:
        layer = alpha_key.removesuffix(".alpha")
        if f"{layer}.lora_down.weight" not in out or f"{layer}.lora_up.weight" not in out:
            raise ValueError(f"{layer} has one half of an adapter (lora_down and lora_up go together)")
    return out


def adapter_rank(state: dict[str, torch.Tensor]) -> int:
    """The adapters' rank: lora_A's rows (every layer's, which must agree)."""
    ranks = {t.shape[0] for k, t in state.items() if k.endswith(".lora_A.weight")}
    if len(ranks) != 1:
        raise ValueError(f"adapters of ranks {sorted(ranks)}: one rank for every layer expected")
    return ranks.pop()


def metadata(rank: int, alpha: float, sampling: dict, teacher: dict, expert: dict | None = None) -> dict[str, str]:
    """The file's `__metadata__` (strings): rank and alpha (also under kohya's `ss_network_dim`/`ss_network_alpha`,
    which LoRA tools read), the student's sampling (K, shift, guidance 1), the teacher the adapters belong to and,
    for one expert of a pair, which one and the boundary."""
    meta = {
        "format": "pt",
        "wandistiller.layout": "lightning-lora",
        "rank": str(rank),
        "alpha": f"{alpha:g}",
        "ss_network_dim": str(rank),
        "ss_network_alpha": f"{alpha:g}",
        "sampling": json.dumps(sampling, sort_keys=True),
        "teacher": json.dumps(teacher, sort_keys=True),
    }
    if expert is not None:
        meta["expert"] = json.dumps(expert, sort_keys=True)
    return meta


def lora_bytes(widths: Iterable[tuple[int, int]], blocks: int, rank: int, dtype: str) -> int:
    """A Lightning-layout file's size from shapes alone (header excluded): per block, for each adapted Linear of
    (in, out) features, down [rank, in] and up [out, rank] in `dtype` and a float32 alpha."""
    per_block = sum(rank * (n_in + n_out) * DTYPES[dtype].itemsize + 4 for n_in, n_out in widths)
    return blocks * per_block
