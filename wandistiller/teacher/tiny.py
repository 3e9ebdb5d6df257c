"""Build the embedded tiny Wan teachers as real diffusers-format folders.

No machine here reaches a model hub, so the default teacher is made locally: a word-level tokenizer,
a UMT5 text encoder, an AutoencoderKLWan, one or two WanTransformer3DModels and Wan's UniPC flow
scheduler, saved with `save_pretrained`. Training then loads the folder through exactly the code
path a downloaded Wan model takes (`teacher.load_teacher`), so nothing downstream knows it is tiny.

Building is deterministic (fixed seeds), so the same folder comes out on every machine.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from wandistiller.core import leftovers
from wandistiller.core.arch import (
    TINY_I2V_MOE_BOUNDARY_RATIO,
    TINY_I2V_MOE_TRANSFORMER,
    TINY_I2V_TRANSFORMER,
    TINY_IMAGE_ENCODER,
    TINY_MOE_BOUNDARY_RATIO,
    TINY_TEXT_ENCODER,
    TINY_TI2V_TRANSFORMER,
    TINY_TRANSFORMER,
    TINY_VAE,
    TINY_VAE_22,
    Layout,
)
from wandistiller.core.assets import DEFAULT_PROMPTS
from wandistiller.core.errors import UserError
from wandistiller.core.precision import cast_keeping_fp32


def _build_tokenizer():
    """A word-level tokenizer over the default prompts' words; T5-like specials (pad=0, eos=1, unk=2)."""
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for p in DEFAULT_PROMPTS.read_text().splitlines() for w in re.findall(r"\w+|[^\w\s]", p.lower())})
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=512
    )


# The embedded teachers (teacher.builtin): how each is built, and the shape the planner reads before it is.
# tiny_i2v is Wan 2.1 I2V's layout, tiny_i2v_moe Wan 2.2 I2V A14B's, tiny_ti2v Wan 2.2 TI2V 5B's.
BUILTINS: dict[str, dict] = {
    "tiny": dict(),
    "tiny_moe": dict(two_experts=True),
    "tiny_i2v": dict(layout=Layout.i2v),
    "tiny_i2v_moe": dict(two_experts=True, layout=Layout.i2v),
    "tiny_ti2v": dict(layout=Layout.ti2v),
}


def tiny_transformer(two_experts: bool = False, layout: Layout = Layout.t2v) -> dict:
    """The transformer config of the embedded teacher built with these arguments."""
    if layout == Layout.i2v:
        return dict(TINY_I2V_MOE_TRANSFORMER if two_experts else TINY_I2V_TRANSFORMER)
    return dict(TINY_TI2V_TRANSFORMER if layout == Layout.ti2v else TINY_TRANSFORMER)


def build_tiny_pipeline(two_experts: bool = False, transformer_config: dict | None = None, layout: Layout = Layout.t2v):
    """A WanPipeline with tiny random components (seeded). Two experts mirror Wan 2.2 A14B.

    `transformer_config` overrides the transformer's (benchmarks: a real-shaped Wan, its weights stored in
    bf16); the text encoder is then as wide as its `text_dim` (4096 for Wan), every other component tiny.
    An image-to-video `layout` builds the pipeline the Hub's folders of that layout name (`tiny_i2v_pipeline`).
    """
    if layout != Layout.t2v:
        return tiny_i2v_pipeline(two_experts, layout)
    config = TINY_TRANSFORMER | (transformer_config or {})
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = _build_tokenizer()
    torch.manual_seed(0)
    text_config = TINY_TEXT_ENCODER | {"d_model": config["text_dim"]}
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **text_config)).eval()
    torch.manual_seed(1)
    vae = AutoencoderKLWan(**TINY_VAE).eval()
    torch.manual_seed(2)
    dtype = torch.float32 if transformer_config is None else torch.bfloat16  # halves a big one's files
    transformer = cast_keeping_fp32(WanTransformer3DModel(**config).eval(), dtype)  # norms stay fp32
    transformer_2 = None
    if two_experts:
        torch.manual_seed(3)
        transformer_2 = cast_keeping_fp32(WanTransformer3DModel(**config).eval(), dtype)
    # What diffusers ships for Wan: UniPC on flow sigmas with shift 3.0.
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=TINY_MOE_BOUNDARY_RATIO if two_experts else None,
    )


def tiny_i2v_pipeline(two_experts: bool, layout: Layout):
    """A tiny random-weight twin of an image-to-video Wan folder, as the Hub's folders of that layout are made:

    - Wan 2.1 I2V (`i2v`, one expert): a WanImageToVideoPipeline whose transformer takes 36 channels and attends to
      a CLIP vision tower's image tokens (image_encoder, image_processor);
    - Wan 2.2 I2V A14B (`i2v`, two experts): the same pipeline without an image encoder, experts split at t = 900;
    - Wan 2.2 TI2V 5B (`ti2v`): a WanPipeline with expand_timesteps over a 48-channel Wan 2.2 VAE (its model_index
      names WanPipeline; WanImageToVideoPipeline loads the same folder to take an image).
    Seeded as `build_tiny_pipeline`: the text encoder and tokenizer are the tiny T2V teacher's.
    """
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    config = tiny_transformer(two_experts, layout)
    tokenizer = _build_tokenizer()
    torch.manual_seed(0)
    text_config = TINY_TEXT_ENCODER | {"d_model": config["text_dim"]}
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **text_config)).eval()
    torch.manual_seed(1)
    vae = AutoencoderKLWan(**(TINY_VAE_22 if layout == Layout.ti2v else TINY_VAE)).eval()
    torch.manual_seed(2)
    transformer = WanTransformer3DModel(**config).eval()
    transformer_2 = None
    if two_experts:
        torch.manual_seed(3)
        transformer_2 = WanTransformer3DModel(**config).eval()
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    )
    common = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer)
    if layout == Layout.ti2v:
        return WanPipeline(**common, expand_timesteps=True)
    image_encoder = image_processor = None
    if config.get("image_dim") is not None:
        torch.manual_seed(4)
        image_encoder = CLIPVisionModel(CLIPVisionConfig(**TINY_IMAGE_ENCODER)).eval()
        side = TINY_IMAGE_ENCODER["image_size"]
        image_processor = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return WanImageToVideoPipeline(
        **common,
        image_encoder=image_encoder,
        image_processor=image_processor,
        transformer_2=transformer_2,
        boundary_ratio=TINY_I2V_MOE_BOUNDARY_RATIO if two_experts else None,
    )


def ensure_tiny_teacher(
    path: str | os.PathLike,
    two_experts: bool = False,
    transformer_config: dict | None = None,
    layout: Layout = Layout.t2v,
) -> Path:
    """Create the tiny teacher folder at `path` unless it is already there; return the path.

    Written to a temporary sibling and renamed, so a crash or a concurrent builder never leaves a
    half-written folder that later looks like a teacher.
    """
    path = Path(path).expanduser()
    if (path / "model_index.json").is_file():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Named for this process, so that the next start can remove it if this one is killed midway.
        leftovers.remove_dead(path.parent, build_pattern(path))
        tmp = path.parent / leftovers.owned_name(f".{path.name}.build")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise cannot_build(path, e) from None
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    # Both libraries draw a bar while saving (transformers' "Writing model shards" for the text encoder).
    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    try:
        build_tiny_pipeline(two_experts, transformer_config, layout).save_pretrained(tmp, safe_serialization=True)
        try:
            tmp.rename(path)
        except OSError:  # another process finished first; theirs is identical
            if not (path / "model_index.json").is_file():
                raise
    except (OSError, SafetensorError) as e:  # a full disk, a quota: safetensors words it "I/O error: ..."
        raise cannot_build(path, e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        diffusers_logging.enable_progress_bar()
        transformers_logging.enable_progress_bar()
    return path


def cannot_build(path: Path, error: Exception) -> UserError:
    """A tiny teacher that cannot be written (a full disk, a quota, a folder not yours): one line, nothing left."""
    why = error.strerror if isinstance(error, OSError) and error.strerror else str(error).rsplit(": ", 1)[-1]
    return UserError(
        f"teacher.path={path}: the tiny teacher cannot be built there ({why}); free some space, or set "
        "paths.cache_dir=<a folder with room> (or WANDISTILLER_CACHE) where it is built once"
    )


def build_pattern(path: Path) -> str:
    """The names of `path`'s temporary build folders (before `-<host>-<pid>`)."""
    return re.escape(f".{path.name}.build")
