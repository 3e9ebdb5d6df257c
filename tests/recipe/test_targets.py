"""wandistiller/recipe/targets.py (with the teacher's `targets` of wandistiller/teacher/model.py it serves): the
guided velocity equals WanPipeline's, routing is in timestep space, the served hidden states' shape is the
teacher's, and targets served by an owner equal a local teacher's bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from diffusers import WanPipeline
from omegaconf import OmegaConf

from tests.conftest import FP32, spawn
from tests.placements.test_streaming import TEACHER
from wandistiller.core.distributed import Topology, roles_for
from wandistiller.data.batches import Batch, BatchSettings, batch_source
from wandistiller.data.prompts import encode_prompts, read_prompts
from wandistiller.placements.cpu import CpuPlacement
from wandistiller.placements.disk import DiskPlacement
from wandistiller.recipe.targets import LocalTargets, OwnerTargets, RemoteTargets, hidden_shape, serve
from wandistiller.teacher.spec import inspect_teacher


def teacher_cfg(**kw):
    return OmegaConf.create({"guidance_scale": 5.0, "guidance_scale_2": None} | kw)


def capture_pipeline_calls(pipe, prompt, steps):
    """Run WanPipeline and record every transformer call: which expert, its inputs and its output."""
    calls = []
    for name in ("transformer", "transformer_2"):
        model = getattr(pipe, name)
        if model is not None:
            model.register_forward_hook(
                lambda m, args, kwargs, out, name=name: calls.append((name, kwargs, out[0])), with_kwargs=True
            )
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    pipe(
        prompt,
        num_frames=1,
        height=64,
        width=64,
        num_inference_steps=steps,
        output_type="latent",
        generator=g,
        guidance_scale=4.0,
        guidance_scale_2=3.0 if pipe.transformer_2 is not None else None,
    )
    return calls


@pytest.mark.parametrize("which", ["tiny", "tiny_moe"])
def test_targets_equal_the_guided_prediction_inside_wan_pipeline(which, tiny_path, tiny_moe_path, cache_dir):
    path = tiny_path if which == "tiny" else tiny_moe_path
    pipe = WanPipeline.from_pretrained(path, dtype=torch.float32, use_safetensors=True)
    calls = capture_pipeline_calls(pipe, "A red fox trotting through fresh snow at dawn", steps=8)
    spec = inspect_teacher(path)
    teacher = CpuPlacement().load(spec, teacher_cfg(guidance_scale=4.0, guidance_scale_2=3.0), FP32, Topology())
    embeddings = encode_prompts(
        spec, ["A red fox trotting through fresh snow at dawn"], "", 512, torch.float32, torch.device("cpu"), cache_dir
    )
    cond, uncond = embeddings.padded(torch.tensor([0])), embeddings.negative_batch(1)
    experts_used = set()
    for (name, kw_cond, out_cond), (_, kw_uncond, out_uncond) in zip(calls[::2], calls[1::2]):
        # The cached embeddings are the pipeline's own, bit for bit.
        assert torch.equal(kw_cond["encoder_hidden_states"], cond)
        assert torch.equal(kw_uncond["encoder_hidden_states"], uncond)
        t = kw_cond["timestep"].float()
        scale = 4.0 if name == "transformer" else 3.0
        expected = out_uncond + scale * (out_cond - out_uncond)
        target, _ = teacher.targets(kw_cond["hidden_states"], t, cond, uncond)
        assert teacher.expert_index(t).item() == (0 if name == "transformer" else 1)
        torch.testing.assert_close(target, expected, rtol=1e-5, atol=1e-5)
        experts_used.add(name)
    assert experts_used == ({"transformer"} if which == "tiny" else {"transformer", "transformer_2"})


def test_two_expert_routing_is_in_timestep_space_at_the_boundary(tiny_moe_path):
    spec = inspect_teacher(tiny_moe_path)
    assert spec.boundary_ratio == 0.875 and spec.boundary_timestep == 875.0
    teacher = CpuPlacement().load(spec, teacher_cfg(), FP32, Topology())
    t = torch.tensor([999.0, 875.0, 874.999, 500.0, 0.0])
    assert teacher.expert_index(t).tolist() == [0, 0, 1, 1, 1]


def test_a_mixed_batch_matches_each_expert_run_alone(tiny_moe_path):
    spec = inspect_teacher(tiny_moe_path)
    teacher = CpuPlacement().load(spec, teacher_cfg(guidance_scale=4.0, guidance_scale_2=3.0), FP32, Topology())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 1, 8, 8, generator=g)
    t = torch.tensor([950.0, 100.0, 880.0, 300.0])
    cond, uncond = torch.randn(4, 512, 32, generator=g), torch.zeros(4, 512, 32)
    together, _ = teacher.targets(x, t, cond, uncond)
    for i in range(4):
        alone, _ = teacher.targets(x[i : i + 1], t[i : i + 1], cond[i : i + 1], uncond[i : i + 1])
        torch.testing.assert_close(together[i : i + 1], alone, rtol=1e-5, atol=1e-5)


def test_the_buffer_a_served_rank_receives_hidden_states_in_is_the_shape_the_teacher_sends(tiny_path):
    spec = inspect_teacher(tiny_path)
    teacher = CpuPlacement().load(spec, teacher_cfg(), FP32, Topology())
    g = torch.Generator().manual_seed(0)
    x_t, cond = torch.randn(3, 16, 1, 8, 8, generator=g), torch.randn(3, 512, 32, generator=g)
    batch = Batch(torch.zeros(3), x_t, torch.tensor([900.0, 500.0, 10.0]), cond, torch.zeros(3, 512, 32))
    _, hidden = LocalTargets(teacher).get(0, 0, batch, (-1,))
    assert hidden_shape(spec.transformer_config, batch, (-1,)) == tuple(hidden.shape) == (1, 3, 16, 32)  # 2x2 patches
    _, two = LocalTargets(teacher).get(0, 0, batch, (0, -1))  # several blocks from the one forward, in order
    assert two.shape == (2, 3, 16, 32) and torch.equal(two[1], hidden[0]) and not torch.equal(two[0], two[1])


def _served_targets(teacher_path: str, cache_dir: str, serving: str) -> dict:
    """Each training rank checks the targets it is served against a teacher of its own."""
    topo = Topology.from_env()
    roles = roles_for(serving, topo)
    spec = inspect_teacher(__import__("pathlib").Path(teacher_path))
    teacher_cfg = OmegaConf.create({"guidance_scale": 4.0, "guidance_scale_2": 3.0})
    emb = encode_prompts(spec, read_prompts(None), "", 512, torch.float32, torch.device("cpu"), cache_dir)
    batch_fn = batch_source(BatchSettings(0, 3, (16, 1, 8, 8), 3.0, 1000, emb))
    teacher = CpuPlacement().load(spec, teacher_cfg, FP32, topo)  # every rank: the owner's, or the reference
    steps, accum, cpu = range(2, 5), 2, torch.device("cpu")
    checked = 0
    if not roles.trains:
        serve(teacher, list(roles.served), batch_fn, steps, accum, (0, -1), cpu)
    else:
        if roles.owner is not None:
            provider = RemoteTargets(roles.owner, spec.transformer_config, cpu)
        else:
            provider = OwnerTargets(teacher, list(roles.served), batch_fn, cpu)
        local = LocalTargets(teacher)
        for step in steps:
            for micro in range(accum):
                batch = batch_fn(step, micro, roles.dp_rank)
                served, served_hidden = provider.get(step, micro, batch, (0, -1))
                mine, mine_hidden = local.get(step, micro, batch, (0, -1))
                assert torch.equal(served, mine) and torch.equal(served_hidden, mine_hidden)
                checked += 1
        provider.finish()
    dist.barrier()
    return {"rank": topo.rank, "checked": checked, "trains": roles.trains}


def _served_targets_check(paths: dict) -> dict:
    """Two ranks, the first also owning the node's teacher (in conftest.two_ranks)."""
    return _served_targets(paths["moe"], paths["cache"], "node_owner")


def _served_targets_worker(teacher_path: str, cache_dir: str, serving: str) -> dict:
    dist.init_process_group("gloo")
    found = _served_targets(teacher_path, cache_dir, serving)
    dist.destroy_process_group()
    return found


def _served_image_targets_check(paths: dict) -> dict:
    """An image-to-video teacher's targets served by the node's owner (Wan 2.1 I2V's layout: mask and image
    latents, CLIP tokens), both ways a rank gets them: its batch rebuilt from the seed (its image drawn with it),
    and its own inputs sent (dmd's), the image then looked up by prompt. Each equals a local teacher's, bit for bit."""
    from wandistiller.data.conditions import ImageBank
    from wandistiller.data.latents import LatentBank

    topo, cpu = Topology.from_env(), torch.device("cpu")
    roles = roles_for("node_owner", topo)
    spec = inspect_teacher(__import__("pathlib").Path(paths["i2v"]))
    emb = encode_prompts(spec, read_prompts(None)[:4], "", 512, torch.float32, cpu, paths["cache"])
    g = torch.Generator().manual_seed(0)  # the same on both ranks: as both read one cached bank
    latents = LatentBank([torch.randn(4, 20, 2, 4, 4, generator=g)], torch.arange(4), 4)
    tokens = LatentBank([torch.randn(4, 5, 24, generator=g)], torch.arange(4), 4)
    images = ImageBank(latents, tokens, torch.arange(4))
    batch_fn = batch_source(BatchSettings(0, 2, (16, 2, 4, 4), 3.0, 1000, emb, images=images))
    teacher = CpuPlacement().load(spec, teacher_cfg(), FP32, topo)  # every rank: the owner's, or the reference

    def text(idx):
        return emb.padded(idx), emb.negative_batch(len(idx)), images.select(idx)

    local, checked = LocalTargets(teacher), 0
    for sends_inputs in (False, True):
        if roles.owner is not None:
            provider = RemoteTargets(roles.owner, spec.transformer_config, cpu, sends_inputs=sends_inputs)
        else:
            provider = OwnerTargets(teacher, list(roles.served), batch_fn, cpu, text if sends_inputs else None)
        for step in range(2):
            batch = batch_fn(step, 0, roles.dp_rank)
            assert batch.image is not None and batch.image.embeds is not None
            served, _ = provider.get(step, 0, batch, ())
            assert torch.equal(served, local.get(step, 0, batch, ())[0])
            checked += 1
        provider.finish()
    return {"rank": topo.rank, "checked": checked}


def test_an_image_to_video_teachers_served_targets_equal_a_local_teachers_on_two_ranks(two_ranks):
    results = [r["_served_image_targets_check"] for r in two_ranks]
    assert [r["checked"] for r in results] == [4, 4]


def test_served_targets_are_bitwise_equal_to_a_local_teachers_on_two_ranks(two_ranks):
    results = [r["_served_targets_check"] for r in two_ranks]
    assert [r["trains"] for r in results] == [True, True] and [r["checked"] for r in results] == [6, 6]


@pytest.mark.slow  # 3 ranks
def test_served_targets_from_a_dedicated_owner_are_bitwise_equal_to_a_local_teachers(tiny_moe_path, cache_dir):
    results = spawn(_served_targets_worker, 3, str(tiny_moe_path), str(cache_dir), "dedicated_owner")
    trained = [r for r in results.values() if r["trains"]]
    assert len(trained) == 2 and all(r["checked"] == 6 for r in trained)


def test_one_teacher_call_per_step_streams_the_weights_once_for_all_micro_batches(tiny_moe_path):
    from wandistiller.data.batches import Batch
    from wandistiller.recipe.targets import LocalTargets, WholeStepTargets

    spec = inspect_teacher(tiny_moe_path)

    def batch_fn(step: int, micro: int, rank: int) -> Batch:
        g = torch.Generator().manual_seed(100 * step + micro)
        x, cond = torch.randn(2, 16, 1, 8, 8, generator=g), torch.randn(2, 512, 32, generator=g)
        return Batch(torch.zeros(2), x, torch.tensor([950.0, 100.0]), cond, torch.zeros(2, 512, 32))

    got, loads = {}, {}
    for name, make in [("per_micro", LocalTargets), ("whole_step", lambda t: WholeStepTargets(t, batch_fn, 0, 3))]:
        teacher = DiskPlacement(resident_blocks=0).load(spec, TEACHER, FP32, Topology())
        targets = make(teacher)
        got[name] = [targets.get(step, m, batch_fn(step, m, 0), (-1,)) for step in range(2) for m in range(3)]
        loads[name] = sum(s.loads for s in teacher.streamers)
    for (t1, h1), (t2, h2) in zip(got["per_micro"], got["whole_step"]):
        torch.testing.assert_close(t2, t1, rtol=1e-4, atol=1e-5)  # same targets, to rounding
        torch.testing.assert_close(h2, h1, rtol=1e-4, atol=1e-5)
    assert loads["whole_step"] * 2 < loads["per_micro"]  # 3 micro-batches, one stream of each expert per step
