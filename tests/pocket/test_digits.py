"""`wandistiller.pocket.digits`: the shipped digits' splits, their rendering and the prompts, called directly."""

from __future__ import annotations

import torch

from wandistiller.pocket.digits import (
    COLOURS,
    PROMPTS,
    TRAIN_FRACTION,
    Attributes,
    load_digits,
    parse_prompt,
    prompt_file_order,
    render,
)


def test_rendered_digits_are_the_colour_the_prompt_says_and_fill_the_canvas():
    from wandistiller.pocket.digits import COLOURS, rendered_split

    images, labels, prompts = rendered_split("heldout", copies=1, seed=3)
    ink = images.sum(1) > 0.2
    rows, cols = ink.any(2).float(), ink.any(1).float()  # [N, 32]: where each image has ink
    assert rows.sum(1).float().mean() >= 20 and cols.sum(1).float().mean() >= 14  # digits span the canvas
    tint = torch.tensor(list(COLOURS.values()))[labels[:, 1]]  # [N, 3]
    mean = images.sum((2, 3)) / images.sum((1, 2, 3)).clamp_min(1e-6)[:, None]  # each channel's share of ink
    assert torch.allclose(mean, tint / tint.sum(1, keepdim=True), atol=1e-4)  # exactly the asked tint
    assert [parse_prompt(p).labels for p in prompts] == [tuple(x) for x in labels.tolist()]
    assert parse_prompt("a  Red 3").labels == (3, 0) and parse_prompt("a fox") is None


def test_the_splits_cut_the_1797_digits_at_80_percent_without_overlap_or_shuffle():
    (train, train_labels), (heldout, heldout_labels) = load_digits("train"), load_digits("heldout")
    assert len(train) == int(1797 * TRAIN_FRACTION) == 1437 and len(heldout) == 1797 - 1437
    assert train.shape[1:] == (8, 8) and 0 <= float(train.min()) and float(train.max()) <= 1  # 0..16 scaled to [0, 1]
    assert set(train_labels.tolist()) == set(heldout_labels.tolist()) == set(range(10))
    # A fixed cut: the same digits every call, and no held-out image is also a training one.
    assert torch.equal(load_digits("train")[0], train)
    assert not {d.numpy().tobytes() for d in heldout} & {d.numpy().tobytes() for d in train}


def test_the_40_prompts_are_every_digit_in_every_colour_and_each_parses_back_to_itself():
    assert len(PROMPTS) == len(set(PROMPTS)) == 10 * len(COLOURS)
    assert PROMPTS[:2] == ["a red 0", "a green 0"]
    assert all(parse_prompt(p).prompt == p for p in PROMPTS)
    assert Attributes(7, 3).prompt == "a yellow 7" and Attributes(7, 3).labels == (7, 3)
    assert parse_prompt("A  GREEN\t5 ") == Attributes(5, 1)  # case and spacing do not matter
    assert parse_prompt("a purple 5") is None and parse_prompt("a red 10") is None and parse_prompt("") is None


def test_the_prompt_file_order_is_a_fixed_shuffle_of_all_prompts():
    order = prompt_file_order()
    assert sorted(order) == sorted(PROMPTS) and order != PROMPTS
    assert order == prompt_file_order()  # seed 0: the shipped prompts.txt is reproducible
    # The last 10% (what a run holds out) mixes several digits and colours.
    held = [parse_prompt(p) for p in order[-4:]]
    assert len({a.digit for a in held}) > 1 and len({a.colour for a in held}) > 1


def test_render_places_the_whole_tinted_digit_on_a_black_canvas_and_its_generator_fixes_the_place():
    digits = torch.ones(3, 8, 8)  # full ink: the 28x28 square shows exactly where it was put
    colour = torch.tensor([0, 1, 2])
    first = render(digits, colour, torch.Generator().manual_seed(5))
    assert first.shape == (3, 3, 32, 32)
    assert torch.equal(first, render(digits, colour, torch.Generator().manual_seed(5)))
    for image, c in zip(first, colour.tolist()):
        inked = image.sum(0) > 0
        assert int(inked.sum()) == 28 * 28 and inked.any(1).sum() == 28 and inked.any(0).sum() == 28
        corner = inked.nonzero()[0]
        assert torch.allclose(image[:, corner[0], corner[1]], torch.tensor(list(COLOURS.values())[c]))
