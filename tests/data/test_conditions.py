"""wandistiller/data/conditions.py: each prompt's image conditioning, fitted like a clip's frames, encoded through
the teacher's own VAE (and CLIP) exactly as teacher/image.py encodes it, cached; bad images refused in one line."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from tests.conftest import encode_condition
from wandistiller.core.errors import UserError
from wandistiller.data import conditions
from wandistiller.data.conditions import check_given, fitted, image_bank
from wandistiller.teacher.image import load_image_encoder
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.teacher.vae import load_vae


def picture(i: int, size=(40, 36), mode="RGB") -> Image.Image:
    rng = np.random.default_rng(i)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).convert(mode)


def test_a_given_image_is_scaled_down_and_center_cropped_to_the_frame_never_up():
    image = fitted(picture(0, (64, 40)), 32, 32, "a.png", "data.root='x'")
    assert image.size == (32, 32) and image.mode == "RGB"
    with pytest.raises(UserError) as e:
        fitted(picture(0, (64, 24)), 32, 32, "a.png", "data.root='x'")
    assert str(e.value).startswith("data.root='x': a.png is 64x24, too small for the run's 32x32 frames")
    assert "lower data.latent_height/latent_width" in str(e.value) and "\n" not in str(e.value)


def test_transparent_pixels_are_refused_and_an_opaque_alpha_channel_or_16_bit_greyscale_is_taken():
    clear = picture(0, mode="RGBA")
    clear.putpixel((0, 0), (1, 2, 3, 0))
    with pytest.raises(UserError, match="has transparent pixels .mode RGBA.*flatten it onto a background"):
        check_given(clear, 32, 32, "a.png", "data.root='x'")
    assert fitted(picture(0, mode="RGBA"), 32, 32, "a.png", "k").mode == "RGB"  # opaque: its RGB as it is
    deep = Image.fromarray(np.full((36, 40), 65535, dtype=np.uint16))  # 16-bit white, not clipped to garbage
    assert fitted(deep, 32, 32, "a.png", "k").getextrema() == ((255, 255),) * 3


def data(**kw):
    return OmegaConf.create(dict(latent_frames=2, latent_height=4, latent_width=4, latent_chunk=2) | kw)


@pytest.mark.parametrize("twin", ["tiny_i2v", "tiny_ti2v"])
def test_the_bank_holds_what_the_pipelines_encoding_gives_each_fitted_image_cached_once(
    twin, request, tmp_path, monkeypatch
):
    spec = inspect_teacher(request.getfixturevalue(f"{twin}_path"))
    cpu, scale = torch.device("cpu"), 16 if spec.latent_channels == 48 else 8
    size = 4 * scale
    images = [picture(i, (size + 8, size + 4)) for i in range(3)]
    opened, names = (lambda i: images[i]), (lambda i: f"image {i}")
    bank = image_bank(spec, opened, names, 3, "fingerprint", data(), tmp_path, cpu, "data.root='x'", progress=False)
    given = [fitted(im, size, size, "", "") for im in images]
    expected = encode_condition(spec, load_vae(spec, cpu), given, 2, size, size, *load_image_encoder(spec, cpu))
    both = bank.select(torch.tensor([2, 0]))
    torch.testing.assert_close(both.latents, expected.latents[[2, 0]], rtol=0, atol=1e-6)
    assert (both.embeds is None) == (expected.embeds is None) == (not spec.image_encoder)
    if expected.embeds is not None:
        torch.testing.assert_close(both.embeds, expected.embeds[[2, 0]], rtol=0, atol=1e-6)
    held = bank.part(slice(2, None))  # the held-out captions' images: prompt 0 of the held-out set is image 2
    assert len(held) == 1 and torch.equal(held.select(torch.tensor([0])).latents, both.latents[:1])
    # Cached: the same bank again loads neither model.
    monkeypatch.setattr(conditions, "load_vae", lambda *a: pytest.fail("a complete cache encodes nothing"))
    monkeypatch.setattr(conditions, "load_image_encoder", lambda *a: pytest.fail("a complete cache encodes nothing"))
    again = image_bank(spec, opened, names, 3, "fingerprint", data(), tmp_path, cpu, "k", progress=False)
    assert torch.equal(again.select(torch.arange(3)).latents, bank.select(torch.arange(3)).latents)


def test_a_float_image_and_one_too_large_for_pil_are_named_for_what_they_are(monkeypatch):
    # An audit's: a mode-F TIFF of 0..1 became an all-black first frame; a 20000x20000 PNG was "not readable".
    floats = Image.fromarray(np.full((64, 64), 0.5, dtype=np.float32))
    with pytest.raises(UserError, match=r"^--image: z.tiff holds floating-point pixels \(mode F\), whose range"):
        fitted(floats, 32, 32, "z.tiff", "--image")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # PIL's guard at 2x: a 64x64 image is over it
    with pytest.raises(Image.DecompressionBombError) as bomb:
        Image.open(io.BytesIO(_png(64)))
    said = conditions.unreadable(bomb.value)
    assert said.startswith("is too large for PIL to decode (Image size (4096 pixels) exceeds limit of 200 pixels")
    assert said.endswith("; scale it down")
    assert conditions.unreadable(OSError("truncated")) == "is not a readable image"


def _png(side: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((side, side, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()
