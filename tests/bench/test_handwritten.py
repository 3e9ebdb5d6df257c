"""Tests wandistiller/bench/handwritten.py, the loop `bench job` compares the framework with: its batches are the
framework's own for (seed, step, micro 0, rank 0) and its guided target is the cond/uncond blend of one batched
teacher call; a tiny real diffusers Wan transformer and tiny prompt embeddings, in-process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from wandistiller.bench.handwritten import GUIDANCE, draw, guided_target
from wandistiller.bench.models import ARCHS
from wandistiller.data.batches import BatchSettings, make_batch
from wandistiller.data.prompts import PromptEmbeddings


@pytest.fixture
def embeddings() -> PromptEmbeddings:
    g = torch.Generator().manual_seed(1)
    embeds = [torch.randn(n, 32, generator=g) for n in (3, 5, 2)]  # prompts of their own token counts
    return PromptEmbeddings(["a", "b", "c"], embeds, torch.randn(4, 32, generator=g), max_sequence_length=8)


def loop_state(embeddings: PromptEmbeddings, teacher=None) -> dict:
    table = torch.stack([embeddings.padded(torch.tensor([i]))[0] for i in range(len(embeddings.embeds))])
    return {"device": torch.device("cpu"), "spec": SimpleNamespace(flow_shift=3.0), "table": table,
            "teacher": teacher, "uncond": embeddings.negative_batch(2)}  # fmt: skip


def test_the_hand_written_batches_are_the_frameworks_for_the_same_seed_and_step(embeddings):
    args = SimpleNamespace(batch=2, seed=7, latent_height=4, latent_width=6)
    for step in (0, 5):
        x_t, t, cond = draw(args, loop_state(embeddings), step)
        framework = make_batch(BatchSettings(7, 2, (16, 1, 4, 6), 3.0, 1000, embeddings), step, micro=0, rank=0)
        torch.testing.assert_close(x_t, framework.x_t)
        torch.testing.assert_close(t, framework.t)
        assert torch.equal(cond, framework.cond)
    assert not torch.equal(draw(args, loop_state(embeddings), 0)[0], draw(args, loop_state(embeddings), 1)[0])


def test_the_guided_target_blends_the_cond_and_uncond_predictions_of_one_call(embeddings):
    torch.manual_seed(0)
    from diffusers import WanTransformer3DModel

    teacher = WanTransformer3DModel(**ARCHS["tiny"]).eval()
    state = loop_state(embeddings, teacher)
    x_t, t, cond = draw(SimpleNamespace(batch=2, seed=0, latent_height=4, latent_width=4), state, 0)
    with torch.no_grad():

        def predict(text):
            return teacher(hidden_states=x_t, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

        on_cond, on_uncond = predict(cond), predict(state["uncond"])
    target = guided_target(state, x_t, t, cond)
    torch.testing.assert_close(target, on_uncond + GUIDANCE * (on_cond - on_uncond), rtol=1e-4, atol=1e-5)
    assert target.shape == x_t.shape and not target.requires_grad
