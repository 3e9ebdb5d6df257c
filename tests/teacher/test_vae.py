"""`wandistiller.teacher.vae`: the tiny teacher's VAE loaded; its latent normalisation both ways, 2 images."""

from __future__ import annotations

import torch
from diffusers import WanPipeline

from wandistiller.teacher.spec import inspect_teacher
from wandistiller.teacher.vae import decode_latents, encode_images, latent_stats, load_vae

CPU = torch.device("cpu")


def pixels() -> torch.Tensor:
    """[2, 3, 32, 32] in [-1, 1]: what the image sources hand the VAE."""
    return torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1


def test_the_vae_loads_frozen_in_the_asked_dtype(tiny_path):
    spec = inspect_teacher(tiny_path)
    vae = load_vae(spec, CPU)
    assert not vae.training and not any(p.requires_grad for p in vae.parameters()) and vae.dtype == torch.float32
    assert load_vae(spec, CPU, torch.bfloat16).dtype == torch.bfloat16


def test_latent_stats_are_the_configs_per_channel_mean_and_std_shaped_to_broadcast(tiny_path):
    spec = inspect_teacher(tiny_path)
    vae = load_vae(spec, CPU)
    mean, std = latent_stats(vae)
    assert mean.shape == std.shape == (1, 16, 1, 1, 1)
    assert mean.flatten().tolist() == torch.tensor(vae.config.latents_mean).tolist()
    assert std.flatten().tolist() == torch.tensor(vae.config.latents_std).tolist()
    assert latent_stats(load_vae(spec, CPU, torch.bfloat16))[1].dtype == torch.bfloat16  # in the VAE's dtype


def test_encoding_gives_the_normalised_posterior_mode_as_float32_on_the_cpu(tiny_path):
    vae = load_vae(inspect_teacher(tiny_path), CPU)
    z = encode_images(vae, pixels())
    assert z.shape == (2, 16, 1, 4, 4) and z.dtype == torch.float32 and z.device == CPU  # 8x down, one frame
    assert torch.equal(encode_images(vae, pixels()), z)  # the mode, not a sample: cached latents are repeatable
    mean, std = latent_stats(vae)
    mode = vae.encode(pixels()[:, :, None]).latent_dist.mode()
    torch.testing.assert_close(z * std + mean, mode)  # normalised as WanPipeline un-normalises


def test_decoding_an_encoded_image_undoes_the_normalisation_exactly(tiny_path):
    spec = inspect_teacher(tiny_path)
    vae = load_vae(spec, CPU)
    images = decode_latents(vae, encode_images(vae, pixels()))
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert 0 <= float(images.min()) and float(images.max()) <= 1
    raw = vae.decode(vae.encode(pixels()[:, :, None]).latent_dist.mode()).sample[:, :, 0]  # [-1, 1], un-normalised
    torch.testing.assert_close(images, (raw / 2 + 0.5).clamp(0, 1), atol=1e-5, rtol=1e-5)
    # A bf16 VAE still hands float32 images and latents back.
    half = load_vae(spec, CPU, torch.bfloat16)
    assert (
        encode_images(half, pixels()).dtype == decode_latents(half, torch.zeros(1, 16, 1, 4, 4)).dtype == torch.float32
    )


def test_decoding_is_wan_pipelines_own(tiny_path):
    pipe = WanPipeline.from_pretrained(tiny_path, dtype=torch.float32, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    noise = torch.randn(1, 16, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    args = dict(prompt="a red fox", latents=noise, num_frames=1, height=64, width=64, num_inference_steps=2)
    latent = pipe(**args, output_type="latent").frames
    image = pipe(**args, output_type="pt").frames[:, 0]
    torch.testing.assert_close(decode_latents(pipe.vae, latent), image)
