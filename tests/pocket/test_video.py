"""The pocket video teacher's parts: grown from the image teacher's without changing what the image prompts meant;
its VAE (the image VAE's 2x-time layout, saying so) makes 5 latent frames of a 9-frame clip."""

from __future__ import annotations

import torch

from wandistiller.pocket import TEACHER_DIR
from wandistiller.pocket.clips import VIDEO_PROMPTS, rendered_clip_split
from wandistiller.pocket.digits import PROMPTS
from wandistiller.pocket.video import (
    POCKET_VIDEO_VAE,
    _unclamped_decode_clip,
    clip_latents,
    decode_clips,
    deepened,
    train_video_decoder,
    video_text_encoder,
    video_tokenizer,
)


def image_parts():
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(TEACHER_DIR, transformer=None)


def test_the_video_tokenizer_keeps_every_image_token_id_and_knows_every_motion_word():
    image = image_parts().tokenizer
    video = video_tokenizer(image)
    assert {k: v for k, v in video.get_vocab().items() if k in image.get_vocab()} == image.get_vocab()
    for prompt in (*PROMPTS[:3], *VIDEO_PROMPTS[:5]):
        ids = video(prompt).input_ids
        assert video.unk_token_id not in ids and ids[-1] == video.eos_token_id
    assert video(PROMPTS[0]).input_ids == image(PROMPTS[0]).input_ids


def test_the_video_text_encoder_reads_an_image_prompt_as_the_image_encoder_does():
    pipe = image_parts()
    video = video_tokenizer(pipe.tokenizer)
    encoder = video_text_encoder(pipe.text_encoder, len(video))
    ids = torch.tensor([pipe.tokenizer(PROMPTS[5]).input_ids])
    with torch.no_grad():
        assert torch.equal(encoder(ids).last_hidden_state, pipe.text_encoder(ids).last_hidden_state)
    assert encoder.get_input_embeddings().weight.shape[0] == len(video) and not encoder.training


def test_the_video_vae_makes_5_latent_frames_of_9_and_decodes_back():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**POCKET_VIDEO_VAE).eval()
    clips, *_ = rendered_clip_split("heldout", seed=0)
    z = clip_latents(vae, clips[:2])
    assert z.shape == (2, 16, 5, 8, 8) and vae.config.scale_factor_temporal == 2
    out = decode_clips(vae, z)
    assert out.shape == clips[:2].shape and out.min() >= 0 and out.max() <= 1
    with torch.no_grad():  # the training decode is the VAE's own, less the clamp
        unclamped = _unclamped_decode_clip(vae, z)
    assert torch.equal(((unclamped.clamp(-1, 1).transpose(1, 2) + 1) / 2).clamp(0, 1), out)


def test_the_decoders_fine_tune_leaves_every_latent_as_it_was():
    """The build trains the video VAE's decoder after its encoder: the transformers, trained on the encoder's latents,
    stay the ones shipped, and only the decoded clips change."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**POCKET_VIDEO_VAE).eval()
    clips, *_ = rendered_clip_split("heldout", seed=0)
    before = {k: v.clone() for k, v in vae.state_dict().items()}
    z, decoded = clip_latents(vae, clips[:2]), decode_clips(vae, clip_latents(vae, clips[:2]))
    trained = train_video_decoder(vae, steps=2, batch=2)
    assert torch.equal(clip_latents(trained, clips[:2]), z)
    assert not torch.equal(decode_clips(trained, z), decoded)
    changed = {k for k, v in trained.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.startswith(("decoder.", "post_quant_conv.")) for k in changed)
    assert not trained.training and not any(p.requires_grad for p in trained.parameters())


def test_a_deepened_transformer_computes_what_it_grew_from_until_training_moves_it():
    from diffusers import WanTransformer3DModel

    from wandistiller.core.arch import TINY_TRANSFORMER

    torch.manual_seed(0)
    small = WanTransformer3DModel(**TINY_TRANSFORMER).eval()
    with torch.no_grad():  # diffusers zero-initialises nothing here, but a trained model's blocks all differ
        for p in small.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    deep = deepened(small, after=(0, 1)).eval()
    assert deep.config.num_layers == len(deep.blocks) == small.config.num_layers + 2
    assert not {p.data_ptr() for p in deep.parameters()} & {p.data_ptr() for p in small.parameters()}  # copies
    x, t = torch.randn(2, 16, 3, 4, 4), torch.tensor([700.0, 90.0])
    text = torch.randn(2, 8, TINY_TRANSFORMER["text_dim"])
    with torch.no_grad():
        assert torch.equal(deep(x, t, text, return_dict=False)[0], small(x, t, text, return_dict=False)[0])
        copy, source = deep.blocks[1], small.blocks[0]  # block 0, then its silent copy
        assert torch.equal(copy.attn1.to_q.weight, source.attn1.to_q.weight)
        assert not copy.ffn.net[2].weight.any() and not copy.attn2.to_out[0].bias.any()
        copy.ffn.net[2].weight.add_(0.1)  # the copy speaks once trained
        assert not torch.equal(deep(x, t, text, return_dict=False)[0], small(x, t, text, return_dict=False)[0])
