"""Inputs: prompts files, cached embeddings, and batches that are a pure function of (seed, step, rank)."""

from __future__ import annotations

import pytest
import torch

from wandistiller.core.errors import UserError
from wandistiller.data.prompts import encode_prompts, make_batch, read_prompts, shifted_sigmas
from wandistiller.teacher.model import inspect_teacher


def test_the_shipped_prompts_are_many_and_varied():
    prompts = read_prompts(None)
    assert len(prompts) >= 64 and len(set(prompts)) == len(prompts)


@pytest.mark.parametrize(
    "content,message", [(None, "does not exist"), ("\n  \n", "holds no prompts"), (b"\xff\xfe\x00", "not UTF-8")]
)
def test_bad_prompts_files_are_refused_with_the_key(tmp_path, content, message):
    path = tmp_path / "prompts.txt"
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError, match=rf"data.prompts_path=.*{message}"):
        read_prompts(str(path))


def test_embeddings_are_computed_once_then_cached(tiny_path, tmp_path):
    spec = inspect_teacher(tiny_path)
    args = (spec, ["a red fox", "a lighthouse at night"], "", 512, torch.float32, torch.device("cpu"), tmp_path)
    first = encode_prompts(*args)
    files = list((tmp_path / "embeddings").glob("*.pt"))
    assert len(files) == 1
    second = encode_prompts(*args)
    assert all(torch.equal(a, b) for a, b in zip(first.embeds, second.embeds))
    assert first.embeds[0].shape == (4, 32)  # "a red fox" + </s>, trimmed; padded again per batch
    assert first.padded(torch.tensor([1, 0])).shape == (2, 512, 32)
    encode_prompts(spec, ["another prompt"], "", 512, torch.float32, torch.device("cpu"), tmp_path)
    assert len(list((tmp_path / "embeddings").glob("*.pt"))) == 2  # the key covers the prompts


def batch(embeddings, **kw):
    args = (
        dict(
            seed=0,
            step=3,
            micro=0,
            rank=0,
            batch_size=4,
            latent_shape=(16, 1, 8, 8),
            flow_shift=3.0,
            num_train_timesteps=1000,
            embeddings=embeddings,
        )
        | kw
    )
    return make_batch(**args)


def test_batches_are_a_pure_function_of_seed_step_micro_rank(tiny_path, tmp_path):
    spec = inspect_teacher(tiny_path)
    emb = encode_prompts(spec, read_prompts(None), "", 512, torch.float32, torch.device("cpu"), tmp_path)
    a, b = batch(emb), batch(emb)
    assert all(x is y is None or torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))
    for change in ({"seed": 1}, {"step": 4}, {"micro": 1}, {"rank": 1}):
        assert not torch.equal(batch(emb, **change).x_t, a.x_t), change
    assert ((a.t >= 0) & (a.t < 1000)).all()


def test_the_flow_shift_moves_timesteps_towards_noise():
    u = torch.linspace(0, 0.999, 100)
    assert torch.equal(shifted_sigmas(u, 1.0), u)
    assert (shifted_sigmas(u, 3.0) >= u).all()
    # Wan 2.2's boundary t=875 at shift 3 falls at 1 - 0.875/(3 - 2*0.875) = 0.30 of the way through u.
    assert abs(float(shifted_sigmas(torch.tensor(0.7), 3.0)) - 0.875) < 1e-6


def test_batches_built_for_a_device_equal_the_cpu_ones_bit_for_bit(tiny_path, tmp_path):
    """The draws stay on the CPU whatever the device; only padding moves (checked here on the CPU device,
    the path CI has; on CUDA the same code adds pinned copies)."""
    spec = inspect_teacher(tiny_path)
    emb = encode_prompts(spec, read_prompts(None), "", 512, torch.float32, torch.device("cpu"), tmp_path)
    a, b = batch(emb), batch(emb, device=torch.device("cpu"))
    assert all(x is y is None or torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))
    assert torch.equal(emb.padded(a.prompt_idx, torch.device("cpu")), emb.padded(a.prompt_idx))
