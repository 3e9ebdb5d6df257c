"""`wandistiller.evaluation.metrics`: prompt accuracy, FID/KID on tensors with known answers; one-line refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from wandistiller.core.errors import UserError
from wandistiller.evaluation.metrics import clip_score, fid_kid, inception_fid, prompt_accuracy


class FirstPixels(nn.Module):
    """Features = the first 4 values of each image: shifting the images shifts the features by as much."""

    num_features = 4

    def forward(self, images):
        return images.flatten(1)[:, :4].double()


def test_prompt_accuracy_counts_only_images_with_every_attribute_right():
    wanted = torch.tensor([[3, 0], [7, 2], [1, 1], [0, 0]])
    predicted = torch.tensor([[3, 0], [5, 2], [1, 0], [0, 0]])
    scores = prompt_accuracy(predicted, wanted)
    assert scores == {"prompt_accuracy": 0.5, "digit_accuracy": 0.75, "colour_accuracy": 0.75}


def test_fid_is_zero_for_the_same_set_and_the_squared_mean_shift_for_a_shifted_one():
    real = torch.rand(200, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    same = fid_kid(real, real.clone(), FirstPixels())
    assert abs(same["fid"]) < 1e-6 and abs(same["kid"]) < 0.01  # KID: subsets drawn apart, an unbiased ~0
    # Equal covariances, means 0.1 apart on each of 4 features: FID = |mu1 - mu2|^2 = 4 * 0.01.
    shifted, far = fid_kid(real, real + 0.1, FirstPixels()), fid_kid(real, real + 0.3, FirstPixels())
    assert shifted["fid"] == pytest.approx(0.04, rel=1e-3) and far["fid"] == pytest.approx(0.36, rel=1e-3)
    assert 0.01 < shifted["kid"] < far["kid"]
    assert fid_kid(real, real[:4], FirstPixels()) == {}  # 4 images of 4 features: withheld, not a number


def test_fid_kid_raises_no_torchmetrics_warning_and_kid_says_what_it_is():
    import warnings

    from wandistiller.evaluation.metrics import KID_MEANING

    real = torch.rand(20, 3, 8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert "kid" in fid_kid(real, real + 0.1, FirstPixels())
    assert [str(w.message) for w in caught] == []  # every pocket eval printed KID's "will save all extracted features"
    assert "unscaled" in KID_MEANING and "not x1000" in KID_MEANING


def test_pocket_scores_say_how_many_images_they_came_from_and_withhold_fid_from_too_few():
    from wandistiller.evaluation.metrics import pocket_scores
    from wandistiller.pocket.digits import rendered_split

    images, _, prompts = rendered_split("heldout", copies=1, seed=7)
    few = pocket_scores(images[:8], prompts[:8], reference=images[100:])  # the end-of-run eval's 8 prompts
    assert few["samples"] == 8 and "fid" not in few and "kid" not in few and few["prompt_accuracy"] > 0.5
    enough = pocket_scores(images[:70], prompts[:70], reference=images[100:])
    assert enough["samples"] == 70 and enough["fid"] >= 0 and "kid" in enough


def test_real_wan_options_refuse_in_one_line_where_their_weights_cannot_be_had(tmp_path):
    with pytest.raises(UserError, match="--clip-model='/nowhere/clip' cannot be loaded"):
        clip_score(torch.rand(2, 3, 32, 32), ["a", "b"], "/nowhere/clip")
    with pytest.raises(UserError, match="--fid-reference=.*fewer than 2 images"):
        inception_fid(torch.rand(2, 3, 32, 32), str(tmp_path))
    from PIL import Image

    from wandistiller.evaluation.metrics import check_real_metrics

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "b.png").write_text("not an image")  # an audit's: PIL's UnidentifiedImageError, an internal error
    with pytest.raises(UserError, match=r"^--fid-reference='.*': b.png is not an image PIL can read \(Unidentified"):
        check_real_metrics(None, str(tmp_path))
    with pytest.raises(UserError, match="--clip-model='/nowhere/clip' cannot be loaded"):
        check_real_metrics("/nowhere/clip", None)


def test_diversity_is_zero_for_identical_images_positive_otherwise_and_withheld_at_one_image_a_prompt():
    from wandistiller.evaluation.metrics import intra_prompt_diversity

    features = torch.rand(6, 4, generator=torch.Generator().manual_seed(0))
    prompts = ["a", "b", "a", "b", "a", "b"]  # as quality/ lays them out: noise by noise, prompts interleaved
    same = torch.cat([features[:2]] * 3)  # each prompt's three images alike
    assert intra_prompt_diversity(same, prompts) == 0.0
    assert intra_prompt_diversity(features, prompts) > 0
    # Two prompts of 2 images, features 1 and 3 apart: the mean of their own spreads.
    two = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 3.0]])
    assert intra_prompt_diversity(two, ["a", "a", "b", "b"]) == pytest.approx(2.0)
    assert intra_prompt_diversity(features[:2], ["a", "b"]) is None  # one image a prompt: withheld


def test_pocket_scores_and_eval_quality_give_diversity_only_for_several_images_a_prompt():
    from wandistiller.evaluation.metrics import eval_quality, pocket_scores
    from wandistiller.pocket.digits import rendered_split

    images, _, prompts = rendered_split("heldout", copies=1, seed=7)
    one = pocket_scores(images[:4], prompts[:4], reference=images[100:])
    assert "diversity" not in one
    alike = pocket_scores(torch.cat([images[:2]] * 2), prompts[:2] * 2, reference=images[100:])
    assert alike["diversity"] == 0.0  # each prompt's two images the same
    other = torch.cat([images[:2], images[2:4]])  # another image under each prompt: features apart
    assert pocket_scores(other, prompts[:2] * 2, reference=images[100:])["diversity"] > 0
    both = eval_quality(prompts[:2] * 2, {"teacher": other, "student": torch.cat([images[:2]] * 2)})
    assert both["student_diversity"] == 0.0 and both["teacher_diversity"] > 0 and both["diversity_ratio"] == 0.0
    assert "diversity_ratio" not in eval_quality(prompts[:4], {"teacher": images[:4], "student": images[:4]})


def test_clip_score_reads_a_local_clip_folder_once_and_is_the_mean_cosine_x_100(tiny_clip, monkeypatch):
    # torchmetrics' own loader takes five Hub ids alone: a downloaded folder (the refusal's own advice) was refused.
    import torch.nn.functional as F
    from transformers import CLIPModel, CLIPProcessor

    from wandistiller.evaluation import metrics

    metrics._clip_model.cache_clear()  # another test of this process may have loaded it
    loads = []
    real = CLIPModel.from_pretrained.__func__
    monkeypatch.setattr(
        CLIPModel, "from_pretrained", classmethod(lambda cls, *a, **k: loads.append(a) or real(cls, *a, **k))
    )
    torch.manual_seed(0)
    images, prompts = torch.rand(3, 3, 32, 32), ["a red 3", "a blue 4", "a long prompt " * 40]  # past 77 tokens
    score = clip_score(images, prompts, str(tiny_clip))
    clip_score(torch.rand(2, 3, 32, 32), ["a green 5", "a red 7"], str(tiny_clip))
    assert len(loads) == 1
    # By hand, through the towers and projections: torchmetrics' mean of 100 x cosine, floored at 0 after the mean
    model, processor = real(CLIPModel, str(tiny_clip)), CLIPProcessor.from_pretrained(str(tiny_clip))
    pixels = processor(images=list((images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()),
                       return_tensors="pt").pixel_values  # fmt: skip
    text = processor(text=prompts, return_tensors="pt", padding=True, truncation=True, max_length=77)
    with torch.no_grad():
        seen = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
        read = model.text_projection(model.text_model(**text).pooler_output)
    expected = float(100 * F.cosine_similarity(seen, read).mean())
    assert expected > 0 and score == pytest.approx(expected, abs=1e-4)  # this folder's seed: a positive mean
