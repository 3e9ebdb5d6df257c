"""Students cut from a Wan transformer (the teacher's, or any folder of the same family), at any depth and width.

Depth: each source block is scored on seeded calibration inputs by the rise in the source's output error when
that block alone is skipped (sources up to Wan 1.3B's size), or by how much it changes the residual stream
(1 - the mean cosine similarity of its input and output tokens; larger sources, one pass): a block that does
nothing scores 0 either way. The highest-scoring blocks are kept, in order (`student.keep_blocks=auto`), or
the ones a list names.
Width (Minitron / PARE style): per kept block, the attention heads (head_dim unchanged) and FFN channels with
the largest mean activation magnitude on the same inputs, and across the model the residual channels with
the largest mean magnitude in the residual stream. Every tensor is sliced consistently, so the result is a
plain WanTransformer3DModel whose config says its shape.

The source is read block by block from its safetensors files (one block in memory at a time), so a 14B
teacher is scored and cut without loading it whole.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from wandistiller.core.arch import ROPE_POSITIONS, estimate_params
from wandistiller.core.errors import UserError
from wandistiller.core.files import OutsideRunFolder, check_tree, opened, read_json_in, write_in_run
from wandistiller.core.tensor_files import safetensors_problem
from wandistiller.teacher.finetune import Patch, patch_tensors

log = logging.getLogger(__name__)

# The calibration batch: seeded random x_t (flow-matching latents are ~N(0,1)), timesteps spread over the
# schedule, random text states; small, since scores are means over tokens.
CALIBRATION = dict(seed=0, batch=8, latent=16, text_tokens=32)
# Keys whose widths a pruning keeps equal to the source's (the heads keep their head_dim).
FIXED = (
    "attention_head_dim",
    "in_channels",
    "out_channels",
    "patch_size",
    "text_dim",
    "freq_dim",
    "qk_norm",
    "cross_attn_norm",
    "image_dim",
)
# Keys a pruning may shrink.
SHRINKS = ("num_attention_heads", "ffn_dim", "num_layers")


def pruning_problem(student: dict, source: dict) -> str | None:
    """Why `student` cannot be cut from `source` (two WanTransformer3DModel configs), in words; None if it can."""
    hd = source.get("attention_head_dim")
    if student.get("attention_head_dim") != hd:
        width = student["num_attention_heads"] * student["attention_head_dim"]
        if width % hd:
            return f"the student's width {width} does not divide into the source's heads of {hd} channels"
        return f"the student's attention_head_dim={student.get('attention_head_dim')} is not the source's {hd}"
    for key in FIXED:
        mine, theirs = _norm(student.get(key)), _norm(source.get(key))
        if mine != theirs and not (key == "cross_attn_norm" and mine in (None, True) and theirs in (None, True)):
            return f"the student's {key}={mine} is not the source's {theirs}"
    for key in SHRINKS:
        if student[key] > source[key]:
            return f"the student's {key}={student[key]} is more than the source's {source[key]}"
    return None


def pruned_shape(source: dict, share: float, estimate) -> dict:
    """The source's shape at no more than `share` of its parameters (by `estimate`), depth first: every block
    the budget allows; in them the most heads that fit with at least half the FFN in proportion to the heads;
    then the FFN grown into what is left (up to the source's). Depth goes last because that is what distilled
    students need here: on the pocket teacher (4 blocks x 6 heads) a tenth kept as 4 blocks x 2 heads reaches
    66% prompt accuracy, as 1 block x 3 heads 12.5% (docs/QUALITY.md); and 10x in the field is mostly width
    (Wan 14B, 40 blocks x 40 heads, against 1.3B's 30 x 12). A 14B tenth is 40 blocks x 14 heads (FFN 2496),
    a quarter 40 x 22 (FFN 4224)."""
    budget, heads, ffn = share * estimate(source), source["num_attention_heads"], source["ffn_dim"]

    def rounded(f: float) -> int:  # a multiple of 64 where that is large (GPU-friendly)
        return int(f) // 64 * 64 if f >= 256 else max(1, int(f))

    def shape(h: int, layers: int, f: int | None = None) -> dict:
        return {
            "num_attention_heads": h,
            "attention_head_dim": source["attention_head_dim"],
            "ffn_dim": f if f is not None else rounded(ffn * h / heads),
            "num_layers": layers,
        }

    for layers in range(source["num_layers"], 0, -1):
        least = lambda h: rounded(ffn * h / heads / 2)
        most = next((h for h in range(heads, 0, -1) if estimate(source | shape(h, layers, least(h))) <= budget), None)
        if most is not None:
            break
    if most is None:
        raise ValueError(f"no shape of the teacher at its head size holds {share:.0%} or less of its parameters")
    best = shape(most, layers, least(most))
    low, high = best["ffn_dim"], ffn  # the largest FFN that still fits: estimate grows with it
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if estimate(source | shape(most, layers, mid)) <= budget else (low, mid - 1)
    return shape(most, layers, max(best["ffn_dim"], rounded(low)))


def keep_blocks_problem(keep, n_student: int, n_source: int) -> str | None:
    """What is wrong with `student.keep_blocks` (auto, even, or a list of source block indices), in words."""
    if isinstance(keep, str) and keep in ("auto", "even"):
        return None
    if not isinstance(keep, (list, tuple)):
        return "is neither auto, even nor a list of block indices"
    keep = list(keep)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in keep):
        return "must list block indices (integers)"
    bad = [i for i in keep if not 0 <= i < n_source]
    if bad:
        return f"names block {bad[0]}, but the source has blocks 0..{n_source - 1}"
    repeated = sorted({i for i in keep if keep.count(i) > 1})
    if repeated:
        return f"names block {repeated[0]} twice; each block can be kept once"
    if len(keep) != n_student:
        return f"keeps {len(keep)} blocks, but the student has num_layers={n_student}"
    return None


def read_folder_config(folder: Path, received: bool = False) -> dict:
    """A WanTransformer3DModel folder's config.json (raises ValueError, in words, if it is not one). `received`: a
    folder someone may have sent (`student.init=<folder>`): read through the guard (core.files), a link out of it
    refused (UserError), and its weights files' headers checked (a truncated or crafted file is one line)."""

    path = folder / "config.json"
    if not folder.is_dir():
        raise ValueError("does not exist" if not folder.exists() else "is not a folder")
    if not path.is_file():
        run = " (a run folder: its student is in student/)" if (folder / "student" / "config.json").is_file() else ""
        raise ValueError(f"holds no config.json{run}; it is not a diffusers model folder")
    if received:
        check_tree(folder)  # every file in it, at any depth: none through a link out of it
    try:
        config = read_json_in(folder, "config.json", what="model config.json")
    except (ValueError, RecursionError) as e:
        raise ValueError(f"has a config.json that cannot be read ({type(e).__name__})") from None
    except OutsideRunFolder:
        raise
    except UserError as e:  # too large, not UTF-8, not a regular file: in words, as the caller words the rest
        raise ValueError(f"has a config.json that cannot be read ({str(e).removeprefix(str(path)).strip()})") from None
    if not isinstance(config, dict) or config.get("_class_name") != "WanTransformer3DModel":
        kind = config.get("_class_name") if isinstance(config, dict) else None
        raise ValueError(f"holds a {kind or 'non-diffusers'} model, not a WanTransformer3DModel")
    if not any(folder.glob("*.safetensors")):
        raise ValueError("holds no .safetensors weights")
    for file in sorted(folder.glob("*.safetensors")) if received else ():
        problem = safetensors_problem(file, root=folder)
        if problem:
            raise ValueError(f"holds a damaged weights file: {problem.replace(str(folder) + '/', '')}")
    if received:
        RECEIVED.add(os.path.realpath(folder))
    return {k: v for k, v in config.items() if not k.startswith("_")}


# Folders read as someone else's (`read_folder_config(received=True)`: a student.init folder), by real path: their
# weights are opened through the guard (core.files.opened), never through a link out of the folder.
RECEIVED: set[str] = set()


def read_tensors(folder: Path, wanted, patch: Patch = ()) -> dict[str, torch.Tensor]:
    """The tensors of a model folder whose key `wanted(key)` accepts, read without loading the rest; with a fine-tuned
    teacher's LoRAs (`patch`: teacher/finetune.py) merged into them, as its loaded experts hold them."""

    state = {}
    guard = os.path.realpath(folder) in RECEIVED  # a teacher's folder (a Hub cache's links to its blobs) is the user's
    for file in sorted(folder.glob("*.safetensors")):  # through the guard: what safetensors reads is what it opened
        with (
            opened(folder, file.name) if guard else contextlib.nullcontext(str(file)) as path,
            safe_open(path, framework="pt") as f,
        ):
            for key in f.keys():
                if wanted(key):
                    state[key] = f.get_tensor(key).float()
    return patch_tensors(state, patch) if patch else state


def _block_state(folder: Path, j: int, patch: Patch = ()) -> dict[str, torch.Tensor]:
    prefix = f"blocks.{j}."
    return {k[len(prefix) :]: v for k, v in read_tensors(folder, lambda k: k.startswith(prefix), patch).items()}


def calibration_inputs(config: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded x_t, timesteps and text states shaped for this transformer."""
    c, g = CALIBRATION, torch.Generator().manual_seed(CALIBRATION["seed"])
    p_t, p_h, p_w = config.get("patch_size") or (1, 2, 2)
    rope = config.get("rope_max_seq_len", ROPE_POSITIONS)
    h, w = min(c["latent"], rope * p_h), min(c["latent"], rope * p_w)
    x = torch.randn(c["batch"], config["in_channels"], p_t, h, w, generator=g)
    t = torch.linspace(1.0, 999.0, c["batch"])
    text = torch.randn(c["batch"], c["text_tokens"], config["text_dim"], generator=g)
    return x, t, text


def _shell(folder: Path, config: dict, patch: Patch = ()):
    """The source with one block (whose weights each block's are loaded into in turn), the rest its own."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(CALIBRATION["seed"])  # the shell's random block is overwritten; seeded all the same
    shell = WanTransformer3DModel.from_config(config | {"num_layers": 1}).eval()
    outer = read_tensors(folder, _outer, patch)
    shell.load_state_dict(outer | {k: v for k, v in shell.state_dict().items() if k.startswith("blocks.")})
    return shell


def _head(shell, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """The source's output (per token, before unpatchifying) from the residual stream after its last block."""
    shift, scale = (shell.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
    return shell.proj_out((shell.norm_out(h.float()) * (1 + scale) + shift).type_as(h))


@torch.no_grad()
def calibrate(folder: Path, config: dict, patch: Patch = ()) -> dict:
    """One streamed pass of the calibration batch through the source: per block its importance score and its
    heads' and FFN channels' importance; the residual channels' importance over the whole stream.

    The score is the rise in the source's output error when the block is skipped (relative to the output's
    size) where the source has at most SKIP_SCORE_MAX_PARAMS parameters, else 1 - the in/out cosine."""
    shell, (x, t, text) = _shell(folder, config, patch), calibration_inputs(config)
    rotary = shell.rope(x)
    h = shell.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()
    temb, proj, text, _ = shell.condition_embedder(t, text, None, timestep_seq_len=None)
    ctx = (text, proj.unflatten(1, (6, -1)), rotary)
    block, heads = shell.blocks[0], config["num_attention_heads"]
    found: dict[str, Any] = {"cosine": [], "attn1": [], "attn2": [], "ffn": [], "channels": torch.zeros(h.shape[-1])}
    keep_states = estimate_params(config) <= SKIP_SCORE_MAX_PARAMS
    states: list[dict | None] = []
    inputs: list[torch.Tensor | None] = []
    taps: dict[str, torch.Tensor] = {}
    hooks = [
        block.attn1.to_out[0].register_forward_pre_hook(lambda m, a: taps.__setitem__("attn1", a[0])),
        block.attn2.to_out[0].register_forward_pre_hook(lambda m, a: taps.__setitem__("attn2", a[0])),
        block.ffn.net[2].register_forward_pre_hook(lambda m, a: taps.__setitem__("ffn", a[0])),
    ]
    try:
        for j in range(config["num_layers"]):
            state = _block_state(folder, j, patch)
            block.load_state_dict(state)
            states.append(state if keep_states else None)
            inputs.append(h if keep_states else None)
            out = block(h, *ctx)
            cos = torch.nn.functional.cosine_similarity(h.float(), out.float(), dim=-1).mean()
            found["cosine"].append(max(0.0, 1.0 - cos.item()))
            for name in ("attn1", "attn2"):
                found[name].append(taps[name].unflatten(-1, (heads, -1)).norm(dim=-1).mean((0, 1)))
            found["ffn"].append(taps["ffn"].abs().mean((0, 1)))
            found["channels"] += h.abs().mean((0, 1))
            h = out
    finally:
        for hook in hooks:
            hook.remove()
    found["channels"] += h.abs().mean((0, 1))
    if keep_states:
        found["scores"], found["score"] = _skip_errors(shell, states, inputs, h, temb, ctx), SKIP_SCORE
    else:
        found["scores"], found["score"] = found["cosine"], COSINE_SCORE
    return found


SKIP_SCORE = "output error when skipped (relative MSE)"
COSINE_SCORE = "1 - in/out cosine"
# Sources up to this size (Wan 1.3B) are scored by skipping each block in turn (their blocks held in memory,
# one forward per block); larger ones (14B) by the one-pass cosine.
SKIP_SCORE_MAX_PARAMS = 2_000_000_000


def _skip_errors(shell, states: list, inputs: list, last: torch.Tensor, temb: torch.Tensor, ctx) -> list[float]:
    """Per block, the source's output error when that block alone is skipped, relative to its output's size."""
    full = _head(shell, last, temb).float()
    size, errors = full.square().mean().item(), []
    for j in range(len(states)):
        h = inputs[j]
        for state in states[j + 1 :]:
            shell.blocks[0].load_state_dict(state)
            h = shell.blocks[0](h, *ctx)
        skipped = _head(shell, h, temb).float()
        errors.append((skipped - full).square().mean().item() / max(size, 1e-12))
    return errors


def _top(importance: torch.Tensor, k: int) -> list[int]:
    """The k most important indices, in their original order (all of them when k is the whole width)."""
    if k >= importance.numel():
        return list(range(importance.numel()))
    return sorted(torch.topk(importance, k, sorted=False).indices.tolist())


def choose_blocks(keep, scores: list[float] | None, n_student: int, n_source: int) -> list[int]:
    """The source blocks a student of n_student blocks keeps: a list as given, evenly spaced, or the highest
    scores (in order; ties keep the earlier block)."""
    if not isinstance(keep, str):
        return list(keep)
    if keep == "even" or n_student >= n_source or scores is None:
        return sorted({round(i * (n_source - 1) / max(n_student - 1, 1)) for i in range(n_student)})
    ranked = sorted(range(n_source), key=lambda j: (-scores[j], j))
    return sorted(ranked[:n_student])


def plan_pruning(student: dict, source: dict, keep, stats: dict | None) -> dict:
    """What to keep: source blocks, per kept block the heads of each attention and the FFN channels, and the
    residual channels. Without calibration stats (the student has the source's widths), every channel."""
    blocks = choose_blocks(
        keep, stats["scores"] if stats is not None else None, student["num_layers"], source["num_layers"]
    )
    heads, ffn, d = student["num_attention_heads"], student["ffn_dim"], heads_width(student)
    if stats is None:
        every = lambda n: list(range(n))
        kept = [{"attn1": every(heads), "attn2": every(heads), "ffn": every(ffn)} for _ in blocks]
        return {"blocks": blocks, "per_block": kept, "channels": every(d)}
    kept = [
        {
            "attn1": _top(stats["attn1"][j], heads),
            "attn2": _top(stats["attn2"][j], heads),
            "ffn": _top(stats["ffn"][j], ffn),
        }
        for j in blocks
    ]
    return {"blocks": blocks, "per_block": kept, "channels": _top(stats["channels"], d)}


def heads_width(config: dict) -> int:
    return config["num_attention_heads"] * config["attention_head_dim"]


# Which index set each dimension of a tensor is sliced by: res (residual channels), res6 (the six modulations
# of the residual), inner (the kept heads' channels), ffn; None keeps the dimension whole.
OUTER_SLICES = {
    r"patch_embedding\.weight": ("res",),
    r"patch_embedding\.bias": ("res",),
    r"condition_embedder\.(time|text)_embedder\.linear_1\.weight": ("res", None),
    r"condition_embedder\.(time|text)_embedder\.linear_2\.weight": ("res", "res"),
    r"condition_embedder\.(time|text)_embedder\.linear_[12]\.bias": ("res",),
    r"condition_embedder\.time_proj\.weight": ("res6", "res"),
    r"condition_embedder\.time_proj\.bias": ("res6",),
    r"proj_out\.weight": (None, "res"),
    r"proj_out\.bias": (None,),
    r"scale_shift_table": (None, None, "res"),
    # Wan 2.1 I2V's image tokens: CLIP-wide in (kept whole), embedded to the residual width.
    r"condition_embedder\.image_embedder\.(norm1|ff\.net\.0\.proj)\.(weight|bias)": (None,),
    r"condition_embedder\.image_embedder\.ff\.net\.2\.weight": ("res", None),
    r"condition_embedder\.image_embedder\.(ff\.net\.2\.bias|norm2\.(weight|bias))": ("res",),
}
BLOCK_SLICES = {
    r"scale_shift_table": (None, None, "res"),
    r"attn[12]\.to_[qkv]\.weight": ("inner", "res"),
    r"attn[12]\.to_[qkv]\.bias": ("inner",),
    r"attn[12]\.norm_[qk]\.weight": ("inner",),
    # The image tokens' keys and values (Wan 2.1 I2V), cut as the text's.
    r"attn2\.add_[kv]_proj\.weight": ("inner", "res"),
    r"attn2\.add_[kv]_proj\.bias": ("inner",),
    r"attn2\.norm_added_k\.weight": ("inner",),
    r"attn[12]\.to_out\.0\.weight": ("res", "inner"),
    r"attn[12]\.to_out\.0\.bias": ("res",),
    r"norm2\.(weight|bias)": ("res",),
    r"ffn\.net\.0\.proj\.weight": ("ffn", "res"),
    r"ffn\.net\.0\.proj\.bias": ("ffn",),
    r"ffn\.net\.2\.weight": ("res", "ffn"),
    r"ffn\.net\.2\.bias": ("res",),
}


def _slice(key: str, tensor: torch.Tensor, table: dict, index: dict) -> torch.Tensor:
    spaces = next((s for pattern, s in table.items() if re.fullmatch(pattern, key)), None)
    if spaces is None:
        raise UserError(f"{key}: a tensor a pruning cannot cut (a Wan transformer of a kind this version does not cut)")
    for dim, space in enumerate(spaces):
        if space is not None:
            tensor = tensor.index_select(dim, index[space])
    return tensor


def pruned_state(folder: Path, source: dict, plan: dict, patch: Patch = ()):
    """The student's tensors, (name, tensor), cut from the source folder's (read one block at a time, so a
    large source is never whole in memory)."""
    d, hd = heads_width(source), source["attention_head_dim"]
    res = torch.tensor(plan["channels"])
    index = {"res": res, "res6": torch.cat([res + k * d for k in range(6)])}
    for key, tensor in read_tensors(folder, _outer, patch).items():
        yield key, _slice(key, tensor, OUTER_SLICES, index)
    for i, (j, kept) in enumerate(zip(plan["blocks"], plan["per_block"])):
        for key, tensor in _block_state(folder, j, patch).items():
            attn = key[:5] if key.startswith("attn") else "attn1"
            inner = torch.tensor([h * hd + c for h in kept[attn] for c in range(hd)])
            block_index = index | {"inner": inner, "ffn": torch.tensor(kept["ffn"])}
            yield f"blocks.{i}.{key}", _slice(key, tensor, BLOCK_SLICES, block_index)


def _outer(key: str) -> bool:
    return not key.startswith("blocks.")


def prune_into(transformer, folder: Path, source: dict, keep="auto", patch: Patch = ()) -> dict:
    """Fill `transformer` (a WanTransformer3DModel cut-able from `source`) with the source folder's weights,
    pruned; returns the record of what was kept and why (what pruning.json holds). The global RNG is left
    as it was."""
    with torch.random.fork_rng(devices=[]):
        return _prune_into(transformer, Path(folder), source, keep, patch)


def _prune_into(transformer, folder: Path, source: dict, keep, patch: Patch) -> dict:
    student = dict(transformer.config)
    same_width = all(student[k] == source[k] for k in ("num_attention_heads", "ffn_dim"))
    scored = not same_width or (keep == "auto" and student["num_layers"] < source["num_layers"])
    stats = calibrate(folder, source, patch) if scored else None
    plan = plan_pruning(student, source, keep, stats)
    params, filled = transformer.state_dict(), set()
    with torch.no_grad():
        for name, tensor in pruned_state(folder, source, plan, patch):
            params[name].copy_(tensor.to(params[name].dtype))
            filled.add(name)
    if filled != set(params):
        missing = sorted(set(params) - filled)[:3]
        raise UserError(f"{folder} lacks {missing}: its weights are incomplete; give a complete Wan transformer folder")
    record = {
        "source": str(folder),
        "keep_blocks": keep if isinstance(keep, str) else list(keep),
        "calibration": CALIBRATION if stats else None,
        "kept_blocks": plan["blocks"],
        "block_score": stats["score"] if stats else None,
        "block_scores": [round(s, 6) for s in stats["scores"]] if stats else None,
        "block_cosine_scores": [round(s, 6) for s in stats["cosine"]] if stats else None,
        "heads": [{k: b[k] for k in ("attn1", "attn2")} for b in plan["per_block"]],
        "ffn_channels": [b["ffn"] for b in plan["per_block"]],
        "residual_channels": plan["channels"],
        "shape": {k: student[k] for k in SHRINKS},
        "source_shape": {k: source[k] for k in SHRINKS},
    }
    log_record(record)
    return record


def log_record(record: dict) -> None:
    scores = record["block_scores"]
    shown = ", ".join(f"{j}:{s:.4f}" for j, s in enumerate(scores)) if scores else "not scored"
    s, t = record["shape"], record["source_shape"]
    log.info(
        "student: cut from %s: blocks %s of %d (block scores, %s: %s); heads %d of %d, ffn %d of %d, width %d channels",
        record["source"],
        record["kept_blocks"],
        t["num_layers"],
        record["block_score"] or "none",
        shown,
        s["num_attention_heads"],
        t["num_attention_heads"],
        s["ffn_dim"],
        t["ffn_dim"],
        len(record["residual_channels"]),
    )


def write_record(record: dict, run_dir: Path) -> Path:
    """pruning.json in the run folder, written whole: a link in its place (a received folder's) is replaced, never
    written through."""

    lines = [f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in record.items()]  # a key a line
    return write_in_run(Path(run_dir), "pruning.json", "{\n" + ",\n".join(lines) + "\n}\n")


def _norm(v):
    return list(v) if isinstance(v, (list, tuple)) else v
