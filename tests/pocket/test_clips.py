"""The pocket video teacher's clips: what they show is what their prompt says, and motion reads back from pixels."""

from __future__ import annotations

from collections import Counter

import torch

from wandistiller.pocket.clips import (
    FRAMES,
    MOTIONS,
    STILL_BELOW,
    TRAVEL,
    VIDEO_PROMPTS,
    parse_video_prompt,
    read_motion,
    render_clips,
    rendered_clip_split,
    speeds,
    velocities,
    video_prompt_file_order,
)
from wandistiller.pocket.digits import COLOURS, load_digits


def test_200_prompts_each_digit_colour_and_motion_and_each_parses_back_to_itself():
    assert len(VIDEO_PROMPTS) == len(set(VIDEO_PROMPTS)) == 10 * len(COLOURS) * len(MOTIONS) == 200
    assert "a red 3 moving left" in VIDEO_PROMPTS and "a blue 0 standing still" in VIDEO_PROMPTS
    for prompt in VIDEO_PROMPTS:
        assert parse_video_prompt(prompt).prompt == prompt
    assert parse_video_prompt("a red 3") is None and parse_video_prompt("A  RED 3 moving   LEFT").motion == 0


def test_the_prompt_file_holds_every_prompt_and_its_first_40_are_balanced():
    order = video_prompt_file_order()
    assert sorted(order) == sorted(VIDEO_PROMPTS) and order == video_prompt_file_order()
    first = [parse_video_prompt(p) for p in order[:40]]
    assert Counter(a.motion for a in first) == {m: 8 for m in range(len(MOTIONS))}
    assert len({(a.digit, a.colour) for a in first}) == 40


def test_clips_move_the_whole_digit_the_asked_way_by_travel_pixels_and_still_ones_stay():
    digits, _ = load_digits("train")
    n = len(MOTIONS)
    clips = render_clips(digits[:n], torch.zeros(n, dtype=torch.long), torch.arange(n), torch.Generator())
    assert clips.shape == (n, FRAMES, 3, 32, 32) and clips.min() >= 0 and clips.max() <= 1
    assert read_motion(clips).tolist() == list(range(n))
    v = velocities(clips) * (FRAMES - 1)
    for m, (dx, dy) in enumerate(MOTIONS.values()):
        assert (v[m] - torch.tensor([dx, dy]) * TRAVEL).abs().max() < 0.3
    # The digit's ink is kept on every frame: nothing slides off the canvas.
    mass = clips.sum((2, 3, 4))
    assert (mass / mass[:, :1]).sub(1).abs().max() < 0.02


def test_motion_reads_back_on_rendered_clips_and_half_the_speed_still_reads_as_moving():
    digits, digit = load_digits("heldout")
    g = torch.Generator().manual_seed(3)
    motion = torch.randint(len(MOTIONS), (60,), generator=g)
    clips = render_clips(digits[:60], torch.randint(len(COLOURS), (60,), generator=g), motion, g)
    labels = torch.stack([digit[:60], torch.zeros(60, dtype=torch.long), motion], 1)
    assert (read_motion(clips) == motion).all()
    moving = labels[:, 2] != list(MOTIONS).index("still")
    assert abs(float(speeds(clips[moving]).mean()) - TRAVEL / (FRAMES - 1)) < 0.01  # (torch.testing imports dynamo)
    slowed = torch.stack([clips[moving][:, i // 2] for i in range(FRAMES)], 1)  # half the speed, same start
    assert (read_motion(slowed) == labels[moving, 2]).all() and STILL_BELOW < TRAVEL / 2


def test_a_split_is_fixed_by_its_seed_and_its_prompts_say_its_labels():
    clips, labels, prompts = rendered_clip_split("heldout", seed=3, frames=3)
    again, *_ = rendered_clip_split("heldout", seed=3, frames=3)
    assert clips.shape == (360, 3, 3, 32, 32) and torch.equal(clips, again)
    assert [parse_video_prompt(p).labels for p in prompts] == [tuple(r) for r in labels.tolist()]


def test_a_black_clip_reads_as_still_at_the_canvas_centre():
    black = torch.zeros(2, FRAMES, 3, 32, 32)
    assert read_motion(black).tolist() == [list(MOTIONS).index("still")] * 2 and (speeds(black) == 0).all()
