"""Training prompts and their cached text embeddings (the per-step batches drawn from them: data/batches.py)."""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from wandistiller.core.assets import DEFAULT_PROMPTS
from wandistiller.core.atomic import held_exclusively, save_tensors
from wandistiller.core.errors import UserError
from wandistiller.core.tensor_files import file_stamps
from wandistiller.teacher.spec import TeacherSpec, loading

log = logging.getLogger(__name__)


def read_prompts(prompts_path: str | None, key: str = "data.prompts_path") -> list[str]:
    """The prompts of a text file, one a line; a UTF-8 byte-order mark (Windows editors add one) is dropped."""
    if prompts_path is not None and not str(prompts_path).strip():  # Path("") is the current folder: said as '.'
        raise UserError(f"{key} is empty (an unset variable?); give a text file with one prompt per line")
    path = DEFAULT_PROMPTS if prompts_path is None else Path(prompts_path).expanduser()
    key = f"{key}={str(path)!r}"
    if path.is_dir():
        raise UserError(f"{key} is a folder; give a text file with one prompt per line")
    if path.exists() and not path.is_file():  # a pipe or a device: reading it could block or never end
        raise UserError(f"{key} is not a regular file (a pipe or a device); give a text file with one prompt per line")
    if not path.is_file():
        raise UserError(f"{key} does not exist; give a text file with one prompt per line")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{key} is not UTF-8 text; give a text file with one prompt per line") from None
    except OSError as e:
        raise UserError(f"{key} cannot be read ({e.strerror}); give a readable text file") from None
    if "\x00" in text:
        raise UserError(f"{key} holds NUL bytes, so it is not a text file; give one prompt per line")
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"{key} holds no prompts; put one prompt per line")
    return prompts


@dataclass
class PromptEmbeddings:
    """Per-prompt text-encoder states, trimmed to each prompt's length (re-padded with zeros per batch,
    exactly as WanPipeline pads), plus the negative prompt's."""

    prompts: list[str]
    embeds: list[torch.Tensor]
    negative: torch.Tensor
    max_sequence_length: int

    def padded(self, indices: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        rows = [self.embeds[i] for i in indices.tolist()]
        if device is not None and device.type != "cpu":  # move the prompts' own tokens only, pad there
            rows = to_device(torch.cat(rows), device).split([len(r) for r in rows])
        return torch.stack([_pad(r, self.max_sequence_length) for r in rows])

    def negative_batch(self, n: int, device: torch.device | None = None) -> torch.Tensor:
        negative = self.negative if device is None else to_device(self.negative, device)
        return _pad(negative, self.max_sequence_length).expand(n, -1, -1)


def _pad(x: torch.Tensor, length: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(length - x.shape[0], x.shape[1])])


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait: through pinned memory on CUDA."""
    if device.type == "cuda":
        x = x.pin_memory()
    return x.to(device, non_blocking=True)


def _cache_key(spec: TeacherSpec, prompts: list[str], negative: str, max_len: int, dtype: torch.dtype) -> str:
    """The text encoder's files alone: a teacher.lora adapts the transformer only (teacher/finetune.py refuses any
    other key), so a fine-tuned teacher shares the plain one's embeddings."""

    encoder = spec.path / "text_encoder"
    weights = file_stamps(encoder, "*.safetensors") + file_stamps(spec.path / "tokenizer", "*")
    blob = json.dumps(
        [
            str(spec.path.resolve()),
            (encoder / "config.json").read_text(),
            weights,
            prompts,
            negative,
            max_len,
            str(dtype),
        ]
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def encode_prompts(
    spec: TeacherSpec,
    prompts: list[str],
    negative_prompt: str,
    max_sequence_length: int,
    dtype: torch.dtype,
    device: torch.device,
    cache_dir: str | os.PathLike,
    warn_unknown: bool = True,
) -> PromptEmbeddings:
    """Text embeddings from the teacher's own encoder, computed once and cached on disk. `warn_unknown`: say where
    the teacher's tokenizer does not know a prompt's words (`unknown_words`).

    Uses WanPipeline.encode_prompt (the pipeline's tokenization, cleaning and padding), then frees the
    encoder: it is never resident during training.
    """
    key = _cache_key(spec, prompts, negative_prompt, max_sequence_length, dtype)
    cache = Path(cache_dir).expanduser() / "embeddings" / f"{key}.pt"
    cached = _cached_embeddings(cache, prompts, max_sequence_length)
    if cached is not None:
        return cached
    # Processes sharing the cache (ranks, a sweep's points, two runs) encode one at a time: the parts folder is
    # theirs in common, and the one that finishes removes it under a writer's feet. The others then read the file.
    with held_exclusively(cache.with_suffix(".lock")):
        return _cached_embeddings(cache, prompts, max_sequence_length) or _encode_and_cache(
            spec, prompts, negative_prompt, max_sequence_length, dtype, device, cache, warn_unknown
        )


def _encode_and_cache(spec, prompts, negative_prompt, max_sequence_length, dtype, device, cache: Path, warn_unknown):
    from diffusers import WanPipeline

    parts = cache.with_suffix(".parts")  # one file per EMBED_CHUNK prompts: a kill keeps the finished ones
    parts.mkdir(parents=True, exist_ok=True)
    starts = range(0, len(prompts), EMBED_CHUNK)
    found = {
        c: _load_part(parts / f"part_{c:06d}.pt", prompts[s : s + EMBED_CHUNK], max_sequence_length)
        for c, s in enumerate(starts)
    }
    damaged = [f"part_{c:06d}.pt" for c, e in found.items() if e is None and (parts / f"part_{c:06d}.pt").exists()]
    if damaged:
        log.warning("text embeddings: %s in %s damaged; encoding those prompts again", ", ".join(damaged), parts)
    new = [p for c, s in enumerate(starts) if found[c] is None for p in prompts[s : s + EMBED_CHUNK]]
    log.info("text embeddings: encoding %d of %d prompts with %s/text_encoder", len(new), len(prompts), spec.path)
    with loading(spec, "text encoder or tokenizer"):
        pipe = WanPipeline.from_pretrained(
            spec.path, transformer=None, transformer_2=None, vae=None, dtype=dtype, use_safetensors=True
        ).to(device)
    unknown = unknown_words(pipe.tokenizer, new) if warn_unknown else {}
    if unknown:  # a pocket teacher asked for "a fox in the snow" drew a digit-like blob without a word
        prompt, words = next(iter(unknown.items()))
        log.warning(
            "text embeddings: %d of %d prompts hold words the teacher's tokenizer does not know (%s in %r); it reads "
            "each as one unknown token, so the teacher draws only what its known words ask for",
            len(unknown), len(new), ", ".join(words[:5]), prompt,
        )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    embeds: list[torch.Tensor] = []
    with torch.no_grad():
        for c, part_start in enumerate(starts):
            if (cached := found[c]) is not None:
                embeds += cached
                continue
            part = _encode_part(pipe, prompts[part_start : part_start + EMBED_CHUNK], max_sequence_length, device)
            save_tensors(
                {"prompts": prompts[part_start : part_start + EMBED_CHUNK], "embeds": part}, parts / f"part_{c:06d}.pt"
            )
            embeds += part
        negative = _encode_part(pipe, [negative_prompt], max_sequence_length, device)[0]
    encoder = weakref.ref(pipe.text_encoder)
    del pipe
    if encoder() is not None:  # a reference cycle holds it: freed before the teacher loads all the same (a whole-heap
        gc.collect()  # pass, ~0.3 s in a long-lived process such as a sweep's, is paid only then)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result = PromptEmbeddings(prompts, embeds, negative, max_sequence_length)
    save_tensors(vars(result), cache)
    shutil.rmtree(parts, ignore_errors=True)  # the whole file now holds them
    return result


def unknown_words(tokenizer, prompts: list[str]) -> dict[str, list[str]]:
    """Each prompt's words that `tokenizer` reads as its unknown token, as the pipeline cleans the prompt: a
    word-level vocabulary's (the pocket and tiny teachers') misses, punctuation aside; T5's sentencepiece has next
    to none. {} where
    the tokenizer has no unknown token or cannot map tokens back to the text (a slow one)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or not prompts or not getattr(tokenizer, "is_fast", False):  # a slow one maps no offsets
        return {}
    texts = [prompt_clean(p) for p in prompts]
    found = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    if "offset_mapping" not in found:
        return {}
    out = {}
    for prompt, text, ids, offsets in zip(prompts, texts, found["input_ids"], found["offset_mapping"]):
        words = [text[a:b] for i, (a, b) in zip(ids, offsets) if i == unk and any(c.isalnum() for c in text[a:b])]
        if words:
            out[prompt] = words
    return out


EMBED_CHUNK = 1024  # prompts per resumable part file (18,000 prompts: 18 parts of ~15 s each)


def _encode_part(pipe, prompts: list[str], max_sequence_length: int, device: torch.device) -> list[torch.Tensor]:
    """One part's embeddings, 16 prompts per encoder call, each cut to its own token count (unpadded)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    part = []
    for start in range(0, len(prompts), 16):
        chunk = prompts[start : start + 16]
        padded, _ = pipe.encode_prompt(
            chunk, do_classifier_free_guidance=False, max_sequence_length=max_sequence_length, device=device
        )
        lengths = pipe.tokenizer(
            [prompt_clean(p) for p in chunk], max_length=max_sequence_length, truncation=True, add_special_tokens=True
        ).input_ids
        part += [e[: len(ids)].cpu().clone() for e, ids in zip(padded, lengths)]
    return part


def _load_part(path: Path, prompts: list[str], max_len: int) -> list[torch.Tensor] | None:
    """A part file's embeddings if it holds these prompts' 2-D rows of one width, else None."""
    try:
        found = torch.load(path, weights_only=True)
        embeds = found["embeds"]
        ok = found["prompts"] == prompts and len(embeds) == len(prompts)
        ok = ok and all(isinstance(e, torch.Tensor) and e.dim() == 2 and 0 < len(e) <= max_len for e in embeds)
        ok = ok and len({e.shape[-1] for e in embeds}) == 1
    except Exception:  # missing, truncated, garbage, other keys: all mean "encode them again"
        return None
    return embeds if ok else None


def _cached_embeddings(cache: Path, prompts: list[str], max_len: int) -> PromptEmbeddings | None:
    """The cached embeddings if the file is whole and holds these prompts; a damaged one is removed (and
    made again by the caller) with one line."""
    if not cache.is_file():
        return None
    try:
        found = PromptEmbeddings(**torch.load(cache, weights_only=True))
        widths = {e.shape[-1] for e in [*found.embeds, found.negative] if e.dim() == 2}
        ok = found.prompts == prompts and len(found.embeds) == len(prompts) and len(widths) == 1
        ok = ok and all(e.dim() == 2 and len(e) <= max_len for e in [*found.embeds, found.negative])
    except Exception:  # truncated, garbage, other keys: torch and the dataclass raise several types
        ok = False
    if ok:
        log.info("text embeddings: cached %s", cache)
        return found
    log.warning("text embeddings: the cache file %s is damaged; encoding the prompts again", cache)
    cache.unlink(missing_ok=True)
    return None
