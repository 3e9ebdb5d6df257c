"""`wandistiller.evaluation.collapse`: the collapse watch's figures of decoded images (diversity, clipped and flat
shares), a student's figures against the teacher's, and the signs said; a share setting outside [0, 1] is one line."""

from __future__ import annotations

import pytest
import torch

from wandistiller.core.errors import UserError
from wandistiller.evaluation.collapse import checked_share, collapse_signs, compared, image_figures


def test_figures_of_decoded_images_and_what_looks_collapsed():
    prompts = ["a", "a", "b", "b"]
    grey = torch.full((4, 3, 16, 16), 0.5)
    assert image_figures(grey, prompts) == {"diversity": 0.0, "saturation": 0.0, "flat": 1.0}
    black = image_figures(torch.zeros(4, 3, 16, 16), prompts)
    assert black["saturation"] == 1.0 and black["flat"] == 1.0
    noise = image_figures(torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(0)), prompts)
    assert noise["flat"] == 0.0 and noise["diversity"] > 5 and noise["saturation"] < 0.02
    teacher = {"diversity": 2.0, "saturation": 0.01, "flat": 0.0}
    assert collapse_signs(compared(teacher, teacher), 0.5, 0.2) == []  # the teacher itself
    assert collapse_signs(compared({"diversity": 0.5, "saturation": 0.01, "flat": 0.0}, teacher), 0.5, 0.2) == [
        "diversity 0.25x the teacher's (under hooks.collapse.min_diversity=0.5)"
    ]
    blown = collapse_signs(compared({"diversity": 2.0, "saturation": 0.6, "flat": 0.5}, teacher), 0.5, 0.2)
    assert blown == ["60% clipped pixels against the teacher's 1%", "50% near-constant images against the teacher's 0%"]
    assert collapse_signs(compared({"diversity": 0.0, "saturation": 1.0, "flat": 1.0}, None), 0.5, 0.2) == []


def test_a_share_setting_is_a_fraction_named_by_its_key():
    assert checked_share("hooks.collapse.max_saturation_rise", 0.2) == 0.2
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(UserError, match="hooks.collapse.max_saturation_rise="):
            checked_share("hooks.collapse.max_saturation_rise", bad)
