"""The pocket image-to-video teacher's parts: grown from the video teacher's so that it starts as the video teacher,
its training clips conditioned as WanImageToVideoPipeline conditions a given image, the conditioning never changing
what a text-to-video build draws; and (slow) the shipped teacher keeps the given digit and moves it as asked."""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel

from wandistiller.core.arch import POCKET_TRANSFORMER, Layout
from wandistiller.pocket import I2V_MOE_TEACHER_DIR, I2V_PAIRS_DIR, I2V_TEACHER_DIR, VIDEO_TEACHER_DIR
from wandistiller.pocket.clips import FRAMES, parse_video_prompt, read_motion
from wandistiller.pocket.i2v import (
    LATENT_FRAMES,
    MASK_CHANNELS,
    POCKET_I2V_TRANSFORMER,
    clips_for,
    first_frame_conditions,
    grown_state,
)
from wandistiller.pocket.train import flow_batch
from wandistiller.teacher.image import condition_latents
from wandistiller.teacher.spec import inspect_teacher

# The shipped teacher, judged as docs/QUALITY.md does; floors under its measured figures (88.3% identity held and
# 100% motion on 40 prompts, 2026-11-30; 80.6% identity on the 20 judged here), a margin for another torch build.
I2V_IDENTITY_FLOOR, I2V_MOTION_FLOOR = 0.75, 0.9


def test_the_grown_transformer_computes_what_the_video_teacher_does_whatever_the_image():
    torch.manual_seed(0)
    video = WanTransformer3DModel(**POCKET_TRANSFORMER).eval()
    grown = WanTransformer3DModel(**POCKET_I2V_TRANSFORMER).eval()
    grown.load_state_dict(grown_state(video.state_dict()))
    x, text = torch.randn(2, 16, LATENT_FRAMES, 8, 8), torch.randn(2, 16, POCKET_TRANSFORMER["text_dim"])
    condition = torch.randn(2, MASK_CHANNELS + 16, LATENT_FRAMES, 8, 8)
    t = torch.tensor([300.0, 800.0])
    with torch.no_grad():
        before = video(x, t, text, return_dict=False)[0]
        after = grown(torch.cat([x, condition], 1), t, text, return_dict=False)[0]
    assert torch.equal(before, after)


def test_a_condition_is_concatenated_after_the_draws_so_text_to_video_builds_draw_as_before():
    latents, cond, uncond = torch.randn(6, 16, 5, 8, 8), torch.randn(6, 4, 8), torch.randn(1, 4, 8)
    condition = torch.randn(6, 18, 5, 8, 8)
    plain = flow_batch(latents, cond, uncond, 3, torch.Generator().manual_seed(1))
    given = flow_batch(latents, cond, uncond, 3, torch.Generator().manual_seed(1), condition=condition)
    assert torch.equal(given[0][:, :16], plain[0]) and given[0].shape[1] == 34
    assert all(torch.equal(a, b) for a, b in zip(given[1:], plain[1:]))
    idx = torch.randint(6, (3,), generator=torch.Generator().manual_seed(1))  # flow_batch's first draw
    assert torch.equal(given[0][:, 16:], condition[idx])


def test_a_prompts_clip_shows_its_digit_and_colour_and_moves_as_it_asks():
    prompts = ["a red 3 moving left", "a blue 9 moving up", "a yellow 5 moving down", "a green 1 standing still"]
    clips = clips_for(prompts, "train", seed=3)
    assert clips.shape == (4, FRAMES, 3, 32, 32)
    assert read_motion(clips).tolist() == [parse_video_prompt(p).motion for p in prompts]  # type: ignore[union-attr]
    assert torch.equal(clips, clips_for(prompts, "train", seed=3)) and not torch.equal(
        clips, clips_for(prompts, "train", 4)
    )


@pytest.mark.skipif(not VIDEO_TEACHER_DIR.is_dir(), reason="the pocket video teacher is not built")
def test_the_training_conditions_are_the_pipelines_of_each_clips_first_frame():
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(VIDEO_TEACHER_DIR, subfolder="vae")
    clips = clips_for(["a red 3 moving left", "a blue 7 moving right"], "test", 0)
    made = first_frame_conditions(vae, clips, batch=1)
    assert made.shape == (2, MASK_CHANNELS + 16, LATENT_FRAMES, 8, 8)
    assert torch.equal(made[:, :MASK_CHANNELS, 0], torch.ones(2, MASK_CHANNELS, 8, 8))
    assert not made[:, :MASK_CHANNELS, 1:].any()
    alone = condition_latents(Layout.i2v, vae, [clips[1, 0]], LATENT_FRAMES, 32, 32)
    assert torch.allclose(made[1:], alone, atol=1e-6)


@pytest.mark.skipif(not I2V_TEACHER_DIR.is_dir(), reason="the pocket I2V teacher is not built")
def test_the_shipped_i2v_teachers_are_i2v_layouts_with_their_pairs():
    from datasets import load_from_disk

    one, pair = inspect_teacher(I2V_TEACHER_DIR), inspect_teacher(I2V_MOE_TEACHER_DIR)
    assert one.layout == pair.layout == Layout.i2v and not one.image_encoder and not pair.image_encoder
    assert pair.boundary_ratio == 0.9 and one.boundary_ratio is None
    pairs = load_from_disk(str(I2V_PAIRS_DIR))
    assert len(pairs) == 200 and all(parse_video_prompt(p) for p in pairs["text"])


@pytest.mark.slow
@pytest.mark.skipif(not I2V_TEACHER_DIR.is_dir(), reason="the pocket I2V teacher is not built")
def test_the_shipped_i2v_teacher_keeps_the_given_digit_and_moves_it_as_asked():
    from diffusers import WanImageToVideoPipeline

    from wandistiller.pocket import FRAME_CLASSIFIER_FILE, VIDEO_PROMPTS_FILE
    from wandistiller.pocket.classifier import load_classifier
    from wandistiller.quality.compare import as_pil

    prompts = VIDEO_PROMPTS_FILE.read_text().split("\n")[:20]
    given = clips_for(prompts, "test", seed=7)[:, 0]
    pipe = WanImageToVideoPipeline.from_pretrained(I2V_TEACHER_DIR)
    pipe.set_progress_bar_config(disable=True)
    clips = torch.cat(
        [
            pipe(
                image=as_pil(frame),
                prompt=p,
                height=32,
                width=32,
                num_frames=FRAMES,
                num_inference_steps=20,
                guidance_scale=3.0,
                max_sequence_length=16,  # the padding it was trained at: 512 zero tokens would dilute the text
                output_type="pt",
                generator=torch.Generator().manual_seed(i),
            ).frames
            for i, (p, frame) in enumerate(zip(prompts, given))
        ]
    )
    wanted = torch.tensor([parse_video_prompt(p).labels for p in prompts])  # type: ignore[union-attr]
    judged = load_classifier(FRAME_CLASSIFIER_FILE).predict(clips.flatten(0, 1)).view(len(prompts), FRAMES, 2)
    assert (judged == wanted[:, None, :2]).all(-1).float().mean() >= I2V_IDENTITY_FLOOR
    assert (read_motion(clips) == wanted[:, 2]).float().mean() >= I2V_MOTION_FLOOR
