"""`wandistiller.pocket.style`: the dim style, its statistic, and the shipped style LoRA as diffusers and
`teacher.lora` read it on the pocket teacher; the builder from fixed seeds (slow)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from wandistiller.pocket import TEACHER_DIR
from wandistiller.pocket.digits import rendered_split
from wandistiller.pocket.style import (
    DIM,
    STYLE_LORA_FILE,
    digit_brightness,
    dimmed,
    normalised,
    save_style_lora,
    train_style_lora,
)
from wandistiller.teacher.finetune import merge, read_lora, teacher_loras
from wandistiller.teacher.spec import inspect_teacher


def test_the_style_dims_the_digit_its_brightness_is_the_statistic_and_normalised_undoes_it_for_the_judge():
    images = rendered_split("heldout")[0][:8]
    plain, dim = digit_brightness(images), digit_brightness(dimmed(images))
    assert torch.allclose(dim, DIM * plain) and float(plain.min()) > 0.5
    assert torch.allclose(normalised(dimmed(images)), normalised(images), atol=1e-6)
    assert float(digit_brightness(normalised(images)).min()) > 0.95  # the peak at 1 (a few pixels clamped there)


def test_the_shipped_style_lora_is_small_and_loads_in_diffusers_as_teacher_lora_merges_it():
    from diffusers import WanPipeline

    assert STYLE_LORA_FILE.stat().st_size < 400_000
    spec = inspect_teacher(TEACHER_DIR)
    (checked,) = teacher_loras([str(STYLE_LORA_FILE)], spec.experts, spec.transformer_config)  # a LoRA of it
    pipe = WanPipeline.from_pretrained(TEACHER_DIR)
    merged = WanPipeline.from_pretrained(TEACHER_DIR).transformer
    merge(merged, read_lora(checked.path), 1.0)
    pipe.load_lora_weights(str(STYLE_LORA_FILE), adapter_name="style")
    pipe.set_adapters(["style"], [1.0])
    g = torch.Generator().manual_seed(0)
    x, t, text = torch.randn(2, 16, 1, 8, 8, generator=g), torch.tensor([900.0, 300.0]), torch.randn(2, 16, 32)
    with torch.no_grad():
        theirs = pipe.transformer(x, t, text, return_dict=False)[0]
        ours = merged(x, t, text, return_dict=False)[0]
    assert (theirs - ours).norm() / ours.norm() < 1e-5


@pytest.mark.slow  # the VAE encodes 2,874 digits first
def test_the_builder_writes_a_diffusers_lora_from_fixed_seeds(tmp_path):
    files = [save_style_lora(train_style_lora(steps=2), tmp_path / f"{i}.safetensors") for i in range(2)]
    assert read_lora(files[0]).keys() == read_lora(STYLE_LORA_FILE).keys()
    # The same tensors and metadata; not the same bytes: safetensors writes its metadata map in hash order
    a, b = (load_file(str(f)) for f in files)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with safe_open(str(files[0]), "pt") as first, safe_open(str(files[1]), "pt") as second:
        assert first.metadata() == second.metadata()
