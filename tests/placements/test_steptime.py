"""The planner's step time (placements/steptime.py): each method's passes of a step, a served teacher's calls,
and the one measured whole job its GPU rate was fitted on."""

from __future__ import annotations

import pytest

from tests.placements.test_planner import FRAME, HARDWARE


def timed(*overrides: str, hardware: str = "40GiB"):
    """(workload, step time by placement) as `planned`'s plan, with the composed method's passes."""
    import torch

    from wandistiller.core.hydra import compose_config
    from wandistiller.job.checks import method_passes, name_the_teacher
    from wandistiller.placements.planner import plan, step_times, workload_of

    gpus = {"40GiB": ["hardware.gpus=1", "hardware.gpu_memory_gib=40", "hardware.host_memory_gib=256"]}
    cfg = compose_config(["teacher=wan2.1_t2v_14b", *FRAME, *gpus.get(hardware, HARDWARE.get(hardware, [])),
                          *overrides])  # fmt: skip
    name_the_teacher(cfg)
    passes = method_passes(cfg)
    found = workload_of(cfg, torch.bfloat16, passes.networks)
    assert found is not None
    return found[0], step_times(plan(*found), *found, passes)


def student_forward_seconds(w) -> float:
    from wandistiller.placements.steptime import GPU_FLOPS, forward_flops

    return forward_flops(w.student_config, w.batch_size, w.tokens, w.text_tokens) / GPU_FLOPS


def test_dmds_step_time_is_kds_plus_its_generations_and_fake_score_passes():
    kd_w, kd = timed()
    dmd_w, dmd = timed("method=dmd")  # K=4, 5 fake-score updates, a student-shaped fake score
    # Per micro-batch (K - 1) / 2 = 1.5 generation calls without grad and a fake-score forward; per update
    # (K + 1) / 2 = 2.5 generation calls and a fake-score forward + backward (3 forwards): 1.5 + 1 + 5 x 5.5 = 30.
    extra = 30 * student_forward_seconds(dmd_w)
    for name in ("gpu", "balanced", "sequential", "offload", "cpu"):
        assert kd[name].teacher_seconds > 0, name
        assert dmd[name].teacher_seconds == pytest.approx(kd[name].teacher_seconds), name  # one call each
        assert dmd[name].seconds - kd[name].seconds == pytest.approx(extra, rel=1e-9), name
    assert dmd["gpu"].samples_per_s < kd["gpu"].samples_per_s
    # Two updates and K=2: 0.5 + 1 + 2 x (1.5 + 3) = 10.5 student-sized forwards more than kd's step.
    _, fewer = timed("method=dmd", "method.steps=2", "method.fake_updates=2")
    assert fewer["gpu"].seconds - kd["gpu"].seconds == pytest.approx(10.5 * student_forward_seconds(dmd_w))


def test_trajectorys_step_has_no_teacher_time_so_every_placement_takes_the_students():
    w, times = timed("method=trajectory")
    assert {t.teacher_seconds for t in times.values()} == {0.0}
    assert [t.seconds for t in times.values()] == pytest.approx([3 * student_forward_seconds(w)] * len(times))


def test_a_served_teacher_calls_for_every_rank_and_a_dedicated_owner_overlaps_the_students():
    w, times = timed(hardware="8x40GiB")  # 8 ranks per node
    gpu, gpu0, balanced = times["gpu"], times["gpu0"], times["balanced"]
    assert gpu0.teacher_seconds == pytest.approx(7 * gpu.teacher_seconds)  # GPU 0 serves the 7 student ranks
    assert gpu0.seconds == pytest.approx(max(gpu0.teacher_seconds, gpu.seconds - gpu.teacher_seconds))
    assert balanced.teacher_seconds == pytest.approx(8 * gpu.teacher_seconds)  # a node owner serves all 8, then trains
    assert balanced.seconds == pytest.approx(balanced.teacher_seconds + gpu.seconds - gpu.teacher_seconds)
    assert gpu.samples_per_s == pytest.approx(8 * w.batch_size / gpu.seconds)
    assert gpu0.samples_per_s == pytest.approx(7 * w.batch_size / gpu0.seconds)


def test_the_step_time_gives_back_the_measured_whole_job_it_was_fitted_on():
    # scripts/gpu_figures.sh step 5 on an H200: 1.3B-shaped teacher, student=small, b16 x 1560 tokens, gpu, bf16 eager.
    _, times = timed("teacher=wan2.1_t2v_1.3b", "trainer.batch_size=16", hardware="1x80GiB")
    assert times["gpu"].samples_per_s == pytest.approx(26.6, rel=0.01)


def test_each_method_declares_its_passes_and_the_plan_names_them():
    from wandistiller.recipe.methods import REGISTRY as methods

    assert methods.get("kd").build().passes(2, whole_step=True).teacher_calls == 1  # one call at the whole step's batch
    assert methods.get("kd").build().passes(2, whole_step=False).teacher_calls == 2
    assert methods.get("trajectory").build(steps=4).passes(1, False).describe() == (
        "a step of method=trajectory: no teacher call (its ODE is sampled once before training: not in the step), "
        "1 student forward + backward"
    )
    regression = methods.get("dmd").build(steps=4, regression_weight=0.5).passes(1, False)
    assert (
        regression.student_trains == 2 and regression.networks[0].trains == 5
    )  # the jump loss's own forward + backward


def test_adapters_on_a_streamed_teacher_stream_it_once_a_forward_and_twice_a_training_pass():
    from dataclasses import replace

    from wandistiller.placements import memory
    from wandistiller.placements.gpu import GpuPlacement
    from wandistiller.placements.memory import GiB, Hardware
    from wandistiller.placements.offload import OffloadPlacement
    from wandistiller.placements.steptime import (
        GPU_FLOPS,
        Passes,
        forward_flops,
        streamed_copy_seconds,
        training_seconds,
    )

    w, _ = timed("method=dmd", "method.fake_score=lora")
    w = replace(w, student_config=w.teacher_config, student_lora_rank=16)  # student=lora
    hw, offload = Hardware((40 * GiB,), 256 * GiB), OffloadPlacement(resident_blocks=0)
    e = offload.estimate(w, hw)
    passes = Passes("dmd", 1, 1, student_forwards=2, student_trains=1, networks=w.networks)  # 1 forward, 5 trains
    forward = forward_flops(w.teacher_config, w.batch_size, w.tokens, w.text_tokens) / GPU_FLOPS
    copies = streamed_copy_seconds(offload, e, w, w.batch_size)  # 40 blocks of a 14B expert from pinned RAM
    assert copies == pytest.approx(40 * memory.block_bytes(w.teacher_config, 2)[1] / 55e9)
    # each forward streams the blocks once; a training pass twice (forward; recomputation + backward)
    per_train = max(forward, copies) + max(3 * forward, copies)
    want = (2 + 1) * max(forward, copies) + (1 + 5) * per_train
    assert training_seconds(offload, e, w, hw, passes) == pytest.approx(want)
    # resident on a GPU: no copies, no recomputation
    gpu = GpuPlacement().estimate(w, Hardware((80 * GiB,), 256 * GiB))
    assert training_seconds(GpuPlacement(), gpu, w, hw, passes) == pytest.approx(forward * (2 + 3 + 1 + 15))


def test_a_placement_declares_its_streams_bandwidth_and_where_its_teacher_computes_and_the_time_follows():
    """A new placement is timed from its declarations alone (`streamed_from`, `teacher_on_cpu`), not its name."""
    from wandistiller.placements import memory
    from wandistiller.placements.cpu import CpuPlacement
    from wandistiller.placements.memory import GiB, Hardware
    from wandistiller.placements.offload import OffloadPlacement
    from wandistiller.placements.steptime import CPU_FLOPS, GPU_FLOPS, forward_flops, teacher_call_seconds

    class Nvme(OffloadPlacement):  # blocks read straight from a fast local drive
        name, streamed_from = "nvme", 7e9

    w, _ = timed()
    hw = Hardware((40 * GiB,), 256 * GiB)
    nvme, e = Nvme(resident_blocks=0), OffloadPlacement(resident_blocks=0).estimate(w, hw)
    streamed = 40 * memory.block_bytes(w.teacher_config, 2)[1] / 7e9  # every block, once per call
    assert teacher_call_seconds(nvme, e, w, hw) == pytest.approx(streamed)  # slower than the call's compute

    class Host(OffloadPlacement):  # not streamed, its teacher computed by the CPU
        name, streamed_from, teacher_on_cpu = "host", None, True

    flops = forward_flops(w.teacher_config, 2 * w.batch_size, w.tokens, w.text_tokens)
    assert teacher_call_seconds(Host(), e, w, hw) == pytest.approx(flops / CPU_FLOPS)
    assert teacher_call_seconds(CpuPlacement(), e, w, hw) == pytest.approx(flops / CPU_FLOPS)
    assert teacher_call_seconds(OffloadPlacement(), e, w, hw) < teacher_call_seconds(nvme, e, w, hw)
    assert flops / GPU_FLOPS < streamed
