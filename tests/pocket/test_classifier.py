"""`wandistiller.pocket.classifier`: the shipped judge on held-out digits; DigitJudge's inputs, round trip."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wandistiller.evaluation.metrics import prompt_accuracy
from wandistiller.pocket.classifier import FEATURES, DigitJudge, load_classifier, save_classifier
from wandistiller.pocket.digits import rendered_split


def test_the_pocket_judge_reads_held_out_real_digits():
    from wandistiller.pocket.classifier import load_classifier
    from wandistiller.pocket.digits import rendered_split

    images, labels, _ = rendered_split("heldout", copies=1, seed=7)
    scores = prompt_accuracy(load_classifier().predict(images), labels)
    assert scores["colour_accuracy"] == 1.0
    assert scores["prompt_accuracy"] >= 0.9  # the digits are real handwriting the judge never saw


def test_uint8_and_larger_images_give_the_features_of_the_32px_float_ones():
    judge = load_classifier()
    images = rendered_split("heldout", copies=1, seed=1)[0][:8]
    features = judge(images)
    assert features.shape == (8, FEATURES) == (8, judge.num_features)
    # torchmetrics hands uint8 in 0..255; those are the float images scaled back to [0, 1].
    as_bytes = (images * 255).round().to(torch.uint8)
    assert torch.allclose(judge(as_bytes), judge(as_bytes.float() / 255), atol=0)
    assert torch.allclose(judge(as_bytes), features, atol=0.05)
    # A 64 px image is resized (antialiased) to the judge's 32 px: it reads the same digit and colour.
    upscaled = F.interpolate(images, scale_factor=2, mode="nearest")
    assert torch.equal(judge.predict(upscaled), judge.predict(images))
    assert (judge(upscaled) - features).norm() < 0.05 * features.norm()


def test_predict_gives_digit_and_colour_rows_the_same_in_any_batch_size():
    judge = load_classifier()
    images, labels, _ = rendered_split("heldout", copies=1, seed=2)
    images, labels = images[:20], labels[:20]
    predicted = judge.predict(images)
    assert predicted.shape == (20, 2) and predicted.dtype == torch.long
    assert torch.equal(judge.predict(images, batch=3), predicted)  # the last, shorter batch included
    digit, colour = judge.heads(images)
    assert torch.equal(predicted, torch.stack([digit.argmax(1), colour.argmax(1)], 1))
    assert (predicted[:, 1] == labels[:, 1]).all()  # colour is the judge's easy half


def test_a_saved_judge_loads_back_frozen_with_the_same_weights(tmp_path):
    torch.manual_seed(0)
    judge = DigitJudge().eval()
    save_classifier(judge, tmp_path / "judge.safetensors")
    loaded = load_classifier(tmp_path / "judge.safetensors")
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    original = judge.state_dict()
    assert all(torch.equal(original[k], v) for k, v in loaded.state_dict().items())
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded.predict(images), judge.predict(images))
