"""The pocket video teacher: `teacher=pocket_video` (one transformer) and `pocket_video_moe` (two experts).

Built by `python -m wandistiller.pocket.build` after the image teacher, from fixed seeds, and started from it
where that saves time (a 2-core CPU builds it):
- the tokenizer is the image teacher's plus the motion words (appended: every image prompt keeps its ids), and
  the text encoder the image teacher's with the new words' embeddings drawn from a fixed seed;
- the VAE is Wan's (`AutoencoderKLWan`) in the image VAE's own layout, whose second stage compresses time 2x
  (9 frames -> 5 latent frames; Wan's own compresses 4x), started from the image VAE's weights (its temporal
  convolutions untrained: a still is a first frame, which skips them) and fine-tuned on clips. A 4x build was
  tried first: with 4 frames of a moving digit in each latent frame, this VAE (base width 8) kept the digit on
  only 44% of frames after the same fine-tune, falling to 10% by frame 17; at 2x it keeps ~93% on every frame.
  Then its decoder alone trains on (`train_video_decoder`): held-out digits through it went from 88.6% of frames
  judged right to 92.9%, with the encoder, so the latents every transformer here learns from, left as they were;
- the transformer is the image teacher's, fine-tuned on the clips' latents (rectified flow, CFG dropout, EMA),
  then grown from 4 blocks to 6 (`deepened`) and trained on, then split into the two experts as the image teacher
  is. Four blocks plateaued near 88% of frames right; six reach 90%, and 94% through the fine-tuned decoder
  (docs/QUALITY.md, "Video");
- a frame judge (the image judge's network, trained on clip frames: a smaller digit, anywhere on the canvas).
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from torch import nn

from wandistiller.core.arch import POCKET_MAX_SEQUENCE_LENGTH, POCKET_VAE
from wandistiller.pocket.classifier import DigitJudge, fit_judge
from wandistiller.pocket.clips import FRAMES, VIDEO_PROMPTS, rendered_clip_split
from wandistiller.pocket.train import cosine_lr

log = logging.getLogger("wandistiller.pocket")
# The image VAE's layout (time 2x, in its second stage), saying so: the image VAE's config keeps diffusers'
# default 4, which no one-frame run reads.
POCKET_VIDEO_VAE = POCKET_VAE | dict(scale_factor_temporal=2)
VAE_TRAIN_FRAMES = FRAMES


def video_tokenizer(image_tokenizer):
    """The image tokenizer's word-level vocabulary with the video prompts' new words appended."""
    vocab = dict(image_tokenizer.get_vocab())
    for word in sorted({w for p in VIDEO_PROMPTS for w in p.split()} - set(vocab)):
        vocab[word] = len(vocab)
    return word_tokenizer(vocab)


def word_tokenizer(vocab: dict[str, int]):
    """A word-level tokenizer over `vocab` with T5-like specials (pad=0, eos=1, unk=2), at the pocket's padding."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=POCKET_MAX_SEQUENCE_LENGTH,
    )


def video_text_encoder(image_encoder, vocab_size: int):
    """The image text encoder with its embedding grown to `vocab_size` (new rows from a fixed seed)."""
    from transformers import UMT5EncoderModel

    config = image_encoder.config.to_dict() | {"vocab_size": vocab_size}
    encoder = UMT5EncoderModel(type(image_encoder.config)(**config)).eval()
    state = image_encoder.state_dict()
    old = state["shared.weight"]
    grown = torch.randn(vocab_size, old.shape[1], generator=torch.Generator().manual_seed(5)) * old.std()
    grown[: len(old)] = old
    state = {k: (grown if k.endswith(("shared.weight", "embed_tokens.weight")) else v) for k, v in state.items()}
    encoder.load_state_dict(state)
    return encoder.requires_grad_(False)


def _unclamped_decode_clip(vae, z: torch.Tensor) -> torch.Tensor:
    """AutoencoderKLWan's decode (latent frame by latent frame, with its causal cache) without the final clamp
    (through it a channel driven below -1 gets no gradient: see train._unclamped_decode)."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    frames = []
    for i in range(z.shape[2]):
        vae._conv_idx = [0]
        chunk = x[:, :, i : i + 1]
        frames.append(vae.decoder(chunk, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0))
    vae.clear_cache()
    return torch.cat(frames, 2)


def train_video_vae(vae, steps: int, batch: int = 8, lr: float = 1e-3, kl: float = 1e-4, seed: int = 0):
    """Fine-tune `vae` on rendered 9-frame clips (reconstruction + a little KL); returns it in eval mode."""
    clips, *_ = rendered_clip_split("train", copies=1, seed=seed + 10, frames=VAE_TRAIN_FRAMES)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(vae.parameters(), lr, weight_decay=0.0)
    vae.train()
    for step in range(steps):
        x = clips[torch.randint(len(clips), (batch,), generator=g)].transpose(1, 2) * 2 - 1  # [B, 3, F, H, W]
        posterior = vae.encode(x).latent_dist
        rec = _unclamped_decode_clip(vae, posterior.sample(generator=g))
        kl_term = 0.5 * (posterior.mean.pow(2) + posterior.var - 1 - posterior.logvar).mean()
        loss = F.mse_loss(rec, x) + kl * kl_term
        cosine_lr(opt, step, steps, lr, warmup=20)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 25 == 0:
            log.info("video vae step %d/%d recon %.5f", step + 1, steps, float(loss.detach() - kl * kl_term.detach()))
    return vae.eval().requires_grad_(False)


def train_video_decoder(vae, steps: int, batch: int = 8, lr: float = 1e-3, seed: int = 1):
    """Fine-tune only `vae`'s decoder (and post_quant_conv) on rendered clips, its encoder frozen: the latents, and so
    every transformer trained on them, stay bit for bit the same, while the clips it decodes sharpen. After the
    300-step fine-tune above, held-out clips through encode + decode kept the judged digit on 88.6% of frames, which
    capped the image-to-video teacher under issue 42's 90%; 1500 decoder steps lift it to 92.9% (docs/QUALITY.md,
    "Video"). Returns `vae` in eval mode."""
    clips, *_ = rendered_clip_split("train", copies=4, seed=20, frames=VAE_TRAIN_FRAMES)
    g = torch.Generator().manual_seed(seed)
    vae.requires_grad_(False)
    trained = [vae.post_quant_conv, vae.decoder]
    params = [p for m in trained for p in m.requires_grad_(True).parameters()]
    opt = torch.optim.AdamW(params, lr, weight_decay=0.0)
    for step in range(steps):
        x = clips[torch.randint(len(clips), (batch,), generator=g)].transpose(1, 2) * 2 - 1  # [B, 3, F, H, W]
        with torch.no_grad():
            z = vae.encode(x).latent_dist.sample(generator=g)
        loss = F.mse_loss(_unclamped_decode_clip(vae, z), x)
        cosine_lr(opt, step, steps, lr, warmup=20)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 100 == 0:
            log.info("video vae decoder step %d/%d recon %.5f", step + 1, steps, float(loss.detach()))
    return vae.eval().requires_grad_(False)


def deepened(transformer, after: tuple[int, ...]):
    """`transformer` (WanTransformer3DModel) with a copy of each block in `after` inserted after it, the copy's
    attention and feed-forward output projections zeroed: each new block adds nothing to its residual stream, so the
    deeper model computes exactly what `transformer` does until training moves it (growing a trained model, rather
    than training a deeper one from the image teacher, keeps what the 4 blocks learned in 19000 steps)."""
    grown = copy.deepcopy(transformer)
    blocks = []
    for i, block in enumerate(grown.blocks):
        blocks.append(block)
        if i in after:
            silent = copy.deepcopy(block)
            for layer in (silent.attn1.to_out[0], silent.attn2.to_out[0], silent.ffn.net[2]):
                nn.init.zeros_(layer.weight)
                nn.init.zeros_(layer.bias)
            blocks.append(silent)
    grown.blocks = nn.ModuleList(blocks)
    grown.register_to_config(num_layers=len(blocks))
    return grown


@torch.no_grad()
def clip_latents(vae, clips: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """Posterior modes (un-normalised) of [N, F, 3, H, W] clips in [0, 1]: [N, C, f, h, w]."""
    rows = [
        vae.encode(clips[i : i + batch].transpose(1, 2) * 2 - 1).latent_dist.mode() for i in range(0, len(clips), batch)
    ]
    return torch.cat(rows)


@torch.no_grad()
def decode_clips(vae, latents: torch.Tensor) -> torch.Tensor:
    """Un-normalised latents [N, C, f, h, w] -> clips [N, F, 3, H, W] in [0, 1] (the VAE's own decode)."""
    return ((vae.decode(latents).sample.transpose(1, 2) + 1) / 2).clamp(0, 1)


def train_frame_judge(steps: int, batch: int = 128, seed: int = 0) -> DigitJudge:
    """The frame judge: DigitJudge fit on single frames of rendered train clips (digit and colour)."""
    torch.manual_seed(seed)
    clips, labels, _ = rendered_clip_split("train", copies=2, seed=seed + 200, frames=FRAMES)
    frames = clips[:, :: (FRAMES - 1) // 4].reshape(-1, *clips.shape[2:])  # 5 frames a clip, first to last
    frame_labels = labels[:, :2].repeat_interleave(frames.shape[0] // len(clips), 0)
    return fit_judge(frames, frame_labels, steps, batch, seed)
