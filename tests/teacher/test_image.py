"""`wandistiller.teacher.image` (with the teacher's `targets` of teacher/model.py that take it): on a tiny twin of each
image-to-video layout, the conditioning, the expert's inputs and its output equal what the model's own diffusers
pipeline computes for the same image, latents and text, bit for bit on CPU; the guided targets (cond and uncond
batched) equal the pipeline's guided velocity to rounding, as the text-to-video targets do."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline
from omegaconf import OmegaConf
from PIL import Image

from tests.conftest import FP32, encode_condition
from wandistiller.core.arch import Layout
from wandistiller.core.distributed import Topology
from wandistiller.data.latents import SamplerSettings, sample_latents
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.teacher.image import (
    TEXT_TOKENS,
    ImageCondition,
    expert_inputs,
    load_image_encoder,
)
from wandistiller.teacher.sampler import image_pipeline
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.teacher.vae import load_vae

SIDE, FRAMES, STEPS = 64, 5, 4
TEXT = TEXT_TOKENS
PATCH = (1, 2, 2)  # 5 frames: 2 latent frames, the given one and one to denoise
# (guidance_scale, guidance_scale_2) per twin: two experts get two scales, so the routing shows in the targets.
SCALES = {"tiny_i2v": (5.0, None), "tiny_i2v_moe": (4.0, 3.0), "tiny_ti2v": (5.0, None)}


def an_image(seed: int, side: int = SIDE) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8))


def run_pipeline(pipe, image, cond, uncond, scale, scale_2):
    """Run the model's own image-to-video pipeline and record, per step, its latents before the step, its timestep
    and each transformer call (expert, inputs, output)."""
    calls, latents_in, timesteps = [], [], []
    for name in ("transformer", "transformer_2"):
        model = getattr(pipe, name)
        if model is not None:
            model.register_forward_hook(
                lambda m, args, kwargs, out, name=name: calls.append((name, kwargs, out[0])), with_kwargs=True
            )

    def step_end(pipe, i, t, kwargs):
        latents_in.append(kwargs["latents"])
        timesteps.append(t)
        return {}

    g = torch.Generator().manual_seed(0)
    shape = (
        1,
        pipe.vae.config.z_dim,
        (FRAMES - 1) // 4 + 1,
        SIDE // pipe.vae_scale_factor_spatial,
        SIDE // pipe.vae_scale_factor_spatial,
    )
    start = torch.randn(shape, generator=g)
    pipe.set_progress_bar_config(disable=True)
    pipe(
        image=image,
        prompt_embeds=cond,
        negative_prompt_embeds=uncond,
        height=SIDE,
        width=SIDE,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=scale,
        guidance_scale_2=scale_2,
        latents=start,
        output_type="latent",
        callback_on_step_end=step_end,
    )
    return calls, [start] + latents_in[:-1], timesteps


@pytest.mark.parametrize("name", list(SCALES))
def test_targets_equal_the_guided_velocity_inside_the_models_own_image_to_video_pipeline(name, request):
    path = request.getfixturevalue(f"{name}_path")
    spec = inspect_teacher(path)
    scale, scale_2 = SCALES[name]
    # TI2V's folder names WanPipeline (text to video); WanImageToVideoPipeline is how diffusers gives it an image.
    pipe = WanImageToVideoPipeline.from_pretrained(path, dtype=torch.float32, use_safetensors=True)
    g = torch.Generator().manual_seed(1)
    # 512 text tokens, as Wan's: diffusers takes the last 512 of text + image tokens as the text (WanAttnProcessor).
    cond, uncond = torch.randn(1, TEXT, 32, generator=g), torch.randn(1, TEXT, 32, generator=g)
    image = an_image(0)
    calls, latents, timesteps = run_pipeline(pipe, image, cond, uncond, scale, scale_2)

    cpu = torch.device("cpu")
    encoder, processor = load_image_encoder(spec, cpu)
    condition = encode_condition(spec, load_vae(spec, cpu), [image], 2, SIDE, SIDE, encoder, processor)
    teacher_cfg = OmegaConf.create({"guidance_scale": scale, "guidance_scale_2": scale_2})
    teacher = CpuPlacement().load(spec, teacher_cfg, FP32, Topology())
    used = set()
    assert len(calls) == 2 * STEPS  # cond then uncond at every step: CFG throughout
    for step, ((expert, kw, out_cond), (_, _, out_uncond)) in enumerate(zip(calls[::2], calls[1::2])):
        hidden = kw["hidden_states"]
        if spec.layout == Layout.i2v:  # the pipeline's own conditioning is ours, bit for bit
            assert torch.equal(hidden[:, 16:], condition.latents)
        else:
            assert torch.equal(hidden[:, :, :1], condition.latents)
            assert kw["timestep"].shape == (1, hidden.shape[2] * (SIDE // 32) ** 2)  # a timestep per token
        image_tokens = kw["encoder_hidden_states_image"]
        assert (image_tokens is None) == (condition.embeds is None)
        assert image_tokens is None or torch.equal(image_tokens, condition.embeds)
        expected = out_uncond + (scale if expert == "transformer" else scale_2) * (out_cond - out_uncond)
        t = timesteps[step].reshape(1).float()
        # The expert's inputs are the pipeline's, bit for bit, and so is one forward on them.
        inputs = expert_inputs(spec.layout, PATCH, latents[step], t, condition, torch.float32)
        assert torch.equal(inputs["hidden_states"], hidden)
        assert torch.equal(inputs["timestep"], kw["timestep"].expand_as(inputs["timestep"]).float())
        alone = teacher.experts[0 if expert == "transformer" else 1](
            **inputs, encoder_hidden_states=cond, return_dict=False
        )[0]
        assert torch.equal(alone, out_cond)
        # The targets run cond and uncond as one batch of two, which the pipeline runs one by one: another
        # kernel shape, so equal to rounding (as the text-to-video targets, tests/recipe/test_targets.py).
        target, _ = teacher.targets(latents[step], t, cond, uncond, image=condition)
        assert teacher.expert_index(t).item() == (0 if expert == "transformer" else 1)
        torch.testing.assert_close(target, expected, rtol=1e-5, atol=1e-5)
        used.add(expert)
    assert used == ({"transformer", "transformer_2"} if len(spec.experts) == 2 else {"transformer"})


def test_an_image_to_video_teacher_without_its_image_is_refused(tiny_i2v_moe_path):
    spec = inspect_teacher(tiny_i2v_moe_path)
    teacher = CpuPlacement().load(
        spec, OmegaConf.create({"guidance_scale": 3.5, "guidance_scale_2": None}), FP32, Topology()
    )
    with pytest.raises(ValueError, match="i2v transformer's inputs need the image"):
        teacher.targets(
            torch.zeros(1, 16, 2, 8, 8), torch.tensor([500.0]), torch.zeros(1, 16, 32), torch.zeros(1, 16, 32)
        )


def test_a_batch_of_images_is_conditioned_as_each_alone(tiny_i2v_path):
    spec = inspect_teacher(tiny_i2v_path)
    cpu = torch.device("cpu")
    vae, (encoder, processor) = load_vae(spec, cpu), load_image_encoder(spec, cpu)
    both = encode_condition(spec, vae, [an_image(1), an_image(2, side=48)], 2, SIDE, SIDE, encoder, processor)
    for i, seed in enumerate((1, 2)):
        alone = encode_condition(spec, vae, [an_image(seed, SIDE if i == 0 else 48)], 2, SIDE, SIDE, encoder, processor)
        torch.testing.assert_close(both.select(slice(i, i + 1)).latents, alone.latents)
        torch.testing.assert_close(both.embeds[i : i + 1], alone.embeds)
    assert isinstance(both, ImageCondition) and both.latents.shape == (2, 4 + 16, 2, 8, 8)
    assert both.latents[:, :4, 0].eq(1).all() and both.latents[:, :4, 1:].eq(0).all()  # the first frame is given


def test_ti2v_without_an_image_is_the_text_to_video_model_wan_pipeline_runs(tiny_ti2v_path):
    from diffusers import WanPipeline

    spec = inspect_teacher(tiny_ti2v_path)
    pipe = WanPipeline.from_pretrained(tiny_ti2v_path, dtype=torch.float32, use_safetensors=True)
    calls = []
    pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append((kw, out[0])), with_kwargs=True)
    g = torch.Generator().manual_seed(1)
    cond, uncond = torch.randn(1, 16, 32, generator=g), torch.randn(1, 16, 32, generator=g)
    pipe.set_progress_bar_config(disable=True)
    pipe(
        prompt_embeds=cond,
        negative_prompt_embeds=uncond,
        height=SIDE,
        width=SIDE,
        num_frames=FRAMES,
        num_inference_steps=2,
        guidance_scale=5.0,
        output_type="latent",
        generator=g,
    )
    teacher = CpuPlacement().load(
        spec, OmegaConf.create({"guidance_scale": 5.0, "guidance_scale_2": None}), FP32, Topology()
    )
    for (kw, out_cond), (_, out_uncond) in zip(calls[::2], calls[1::2]):
        t = kw["timestep"][:, :1].flatten()
        inputs = expert_inputs(spec.layout, PATCH, kw["hidden_states"], t, None, torch.float32)
        assert torch.equal(inputs["timestep"], kw["timestep"]) and torch.equal(
            inputs["hidden_states"], kw["hidden_states"]
        )
        target, _ = teacher.targets(kw["hidden_states"], t, cond, uncond)
        torch.testing.assert_close(target, out_uncond + 5.0 * (out_cond - out_uncond), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(SCALES))
def test_the_image_pipeline_on_a_cached_condition_samples_what_the_models_own_pipeline_samples_from_the_image(
    name, request
):
    """`image_pipeline` given an ImageCondition encoded once (a training run's probe images) draws the same clip as
    WanImageToVideoPipeline encoding the image itself, and as `image_pipeline` given the image: the loop is the
    pipeline's own either way."""
    path = request.getfixturevalue(f"{name}_path")
    spec = inspect_teacher(path)
    scale, scale_2 = SCALES[name]
    cpu = torch.device("cpu")
    own = WanImageToVideoPipeline.from_pretrained(path, dtype=torch.float32, use_safetensors=True)
    own.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(3)
    cond, uncond = torch.randn(1, TEXT, 32, generator=g), torch.randn(1, TEXT, 32, generator=g)
    image = an_image(4)
    shape = (own.vae.config.z_dim, 2, SIDE // own.vae_scale_factor_spatial, SIDE // own.vae_scale_factor_spatial)
    noise = torch.randn(1, *shape, generator=g)
    kwargs = dict(prompt_embeds=cond, negative_prompt_embeds=uncond, latents=noise, guidance_scale=scale)
    expected = own(
        image=image,
        **kwargs,
        guidance_scale_2=scale_2,
        height=SIDE,
        width=SIDE,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        output_type="latent",
    ).frames

    encoder = load_image_encoder(spec, cpu)
    vae = load_vae(spec, cpu)
    condition = encode_condition(spec, vae, [image], 2, SIDE, SIDE, *encoder)
    teacher_cfg = OmegaConf.create({"guidance_scale": scale, "guidance_scale_2": scale_2})
    teacher = CpuPlacement().load(spec, teacher_cfg, FP32, Topology())
    pipe = image_pipeline(spec, teacher.experts, cpu, vae, image_encoder=encoder)
    settings = SamplerSettings(STEPS, tuple(teacher.guidance_scales), shape)
    from_image = sample_latents(pipe, noise, cond, uncond, settings, image=image)
    from_cache = sample_latents(pipe, noise, cond, uncond, settings, condition=condition)
    assert torch.equal(from_image, expected.float())
    assert torch.equal(from_cache, expected.float())
    assert not torch.equal(from_cache, sample_latents(pipe, noise, cond, uncond, settings, image=an_image(5)))
