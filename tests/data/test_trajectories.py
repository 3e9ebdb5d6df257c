"""wandistiller/data/trajectories.py: the teacher's ODE points at a few-step student's sigmas are WanPipeline's own
latents from the same noise (every point), and for K = 1 the default schedule's sample itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import FP32
from wandistiller.core.distributed import Topology
from wandistiller.data.latents import SamplerSettings, noise_for, sample_latents
from wandistiller.data.prompts import PromptEmbeddings
from wandistiller.data.trajectories import STREAM, TrajectorySettings, ode_sigmas, teacher_trajectories
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.teacher.fewstep import student_schedule
from wandistiller.teacher.sampler import wan_pipeline
from wandistiller.teacher.spec import inspect_teacher

SHAPE = (16, 1, 8, 8)


def test_the_teachers_steps_split_among_the_students_intervals_and_land_on_its_sigmas():
    sigmas = [1.0, 0.9375, 0.8, 0.5, 0.0]
    given, landed = ode_sigmas(sigmas, 20, 3.0, 1000)
    assert len(given) == 20 and landed[-1] == 20 and all(a < b for a, b in zip(landed, landed[1:]))
    shifted = 3 * given / (1 + 2 * given)
    assert np.allclose(shifted[[0, *landed[:-1]]], sigmas[:-1])
    one, _ = ode_sigmas([1.0, 0.0], 7, 3.0, 1000)  # K = 1: the scheduler's own default
    assert np.array_equal(one, np.linspace(1, 1 / 1000, 8)[:-1])
    with pytest.raises(ValueError):
        ode_sigmas(sigmas, 3, 3.0, 1000)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    spec = inspect_teacher(tiny_path)
    teacher = CpuPlacement().load(spec, OmegaConf.create({"guidance_scale": 5.0, "guidance_scale_2": None}), FP32,
                                  Topology())  # fmt: skip
    g = torch.Generator().manual_seed(0)
    embeddings = PromptEmbeddings(
        ["a", "b"], [torch.randn(n, 32, generator=g) for n in (3, 5)], torch.zeros(0, 32), 512
    )
    return spec, teacher, embeddings


def test_the_cached_points_are_wanpipelines_latents_from_the_same_noise(tiny, tmp_path):
    spec, teacher, embeddings = tiny
    _, sigmas = student_schedule(spec, 2)
    settings = TrajectorySettings(SamplerSettings(6, (5.0,), SHAPE, 2), tuple(sigmas.double().tolist()))
    bank = teacher_trajectories(teacher, embeddings, 0, settings, tmp_path, chunk_size=3, progress=False)
    assert len(bank) == 4 and bank.latent_shape == (3, *SHAPE)
    given, landed = ode_sigmas(settings.sigmas, 6, 3.0, 1000)
    item = 3  # prompt 1, its second noise: the last chunk, one row (a batch of one, as the pipeline call below)
    noise = noise_for(0, 1, 1, SHAPE, STREAM)[None]
    pipe = wan_pipeline(spec, teacher.experts, teacher.device)
    own = type(pipe.scheduler).set_timesteps
    pipe.scheduler.set_timesteps = lambda n, device=None: own(pipe.scheduler, device=device, sigmas=given)
    seen = []
    out = pipe(prompt_embeds=embeddings.padded(torch.tensor([1])), negative_prompt_embeds=embeddings.negative_batch(1),
               latents=noise, guidance_scale=5.0, num_inference_steps=6, height=64, width=64, num_frames=1,
               output_type="latent", callback_on_step_end=lambda p, i, t, k: seen.append(k["latents"].clone()) or {},
               ).frames  # fmt: skip
    points = bank.x0(torch.tensor([item]))[0]
    assert torch.equal(points[0], noise[0]) and torch.equal(points[-1], out[0].float())
    assert torch.equal(points[1], seen[landed[0] - 1][0])  # the intermediate point: the step that lands on sigma_1


def test_one_student_step_ends_at_the_sample_of_the_teachers_default_schedule(tiny, tmp_path):
    spec, teacher, embeddings = tiny
    settings = TrajectorySettings(SamplerSettings(5, (5.0,), SHAPE, 1), (1.0, 0.0))
    bank = teacher_trajectories(teacher, embeddings, 0, settings, tmp_path, chunk_size=1, progress=False)
    noise = noise_for(0, 0, 0, SHAPE, STREAM)[None]
    pipe = wan_pipeline(spec, teacher.experts, teacher.device)  # no sigmas given: the scheduler's default
    sample = sample_latents(pipe, noise, embeddings.padded(torch.tensor([0])), embeddings.negative_batch(1),
                            settings.sampler)  # fmt: skip
    assert torch.equal(bank.x0(torch.tensor([0]))[0, -1], sample[0])


def test_a_trajectory_cache_larger_than_its_disk_is_one_line_before_the_teacher_samples(tmp_path):
    from wandistiller.core.errors import UserError
    from wandistiller.data.trajectories import check_cache_size

    check_cache_size(tmp_path / "cache" / "trajectories" / "key", 10, (3, 16, 1, 8, 8))  # 120 KiB: fits
    with pytest.raises(UserError, match=r"take [\d,.]+ GiB \(10,000,000,000 items .*method.noises_per_prompt") as e:
        check_cache_size(tmp_path / "cache" / "trajectories" / "key", 10**10, (3, 16, 1, 8, 8))
    assert "\n" not in str(e.value) and not (tmp_path / "cache").exists()  # nothing made


@pytest.mark.parametrize(
    "twin",
    [
        "tiny_i2v",
        pytest.param("tiny_i2v_moe", marks=pytest.mark.slow),
        pytest.param("tiny_ti2v", marks=pytest.mark.slow),
    ],
)
def test_an_image_to_video_teachers_points_end_where_its_own_pipeline_ends_from_each_prompts_image(
    twin, request, tmp_path
):
    """The ODE of an image-to-video teacher runs in its own pipeline from each prompt's image (a chunk spanning two
    prompts runs each from its own): at K = 1 its last point is what the image pipeline samples from the PIL image,
    bit for bit (TI2V: over the frames it denoises; its given first frame is replaced only after the loop). The cache
    is keyed on the images."""
    from tests.conftest import encode_condition
    from tests.teacher.test_image import SCALES, SIDE, TEXT, an_image
    from wandistiller.data.conditions import ImageBank
    from wandistiller.data.latents import LatentBank
    from wandistiller.data.trajectories import trajectories_folder
    from wandistiller.teacher.image import ImageCondition, denoised_frames, load_image_encoder
    from wandistiller.teacher.sampler import image_pipeline
    from wandistiller.teacher.vae import load_vae

    spec = inspect_teacher(request.getfixturevalue(f"{twin}_path"))
    scale, scale_2 = SCALES[twin]
    cpu = torch.device("cpu")
    teacher = CpuPlacement().load(spec, OmegaConf.create({"guidance_scale": scale, "guidance_scale_2": scale_2}), FP32,
                                  Topology())  # fmt: skip
    g = torch.Generator().manual_seed(0)
    embeddings = PromptEmbeddings(["a", "b"], [torch.randn(TEXT, 32, generator=g) for _ in range(2)],
                                  torch.zeros(0, 32), TEXT)  # fmt: skip
    vae, encoder = load_vae(spec, cpu), load_image_encoder(spec, cpu)
    pictures = [an_image(1), an_image(2)]
    # Each encoded alone, as the pipeline encodes its one image (a batch's VAE pass is equal only to rounding).
    condition = ImageCondition.cat([encode_condition(spec, vae, [p], 2, SIDE, SIDE, *encoder) for p in pictures])
    embeds = None if condition.embeds is None else LatentBank([condition.embeds], torch.arange(2), 2)
    images = ImageBank(LatentBank([condition.latents], torch.arange(2), 2), embeds, torch.arange(2))
    pipe = image_pipeline(spec, teacher.experts, cpu, vae, image_encoder=encoder)
    side = SIDE // pipe.vae_scale_factor_spatial
    shape = (vae.config.z_dim, 2, side, side)  # 2 latent frames: the clip the images were encoded for
    settings = TrajectorySettings(SamplerSettings(3, tuple(teacher.guidance_scales), shape, 2), (1.0, 0.0))
    # Chunks of 3 with 2 noises a prompt: [prompt 0, prompt 0, prompt 1], [prompt 1].
    bank = teacher_trajectories(teacher, embeddings, 0, settings, tmp_path, 3, False, None, images)
    for item in (2, 3):  # prompt 1's, each a call of one (as the one below)
        noise = noise_for(0, 1, item % 2, shape, STREAM)[None]
        sample = sample_latents(pipe, noise, embeddings.padded(torch.tensor([1])), embeddings.negative_batch(1),
                                settings.sampler, image=pictures[1])  # fmt: skip
        given = condition.select(slice(1, 2))
        points = bank.x0(torch.tensor([item]))
        assert torch.equal(points[:, 0], noise)
        assert torch.equal(denoised_frames(given, points[:, -1]), denoised_frames(given, sample))
    other = ImageBank(images.latents, images.embeds, torch.tensor([1, 0]))  # the same images, given the other way
    folders = {trajectories_folder(spec, embeddings, 0, settings, FP32.teacher_dtype, tmp_path, None, bank_of)
               for bank_of in (None, images, other)}  # fmt: skip
    assert len(folders) == 3
