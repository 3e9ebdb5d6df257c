"""Tests of wandistiller/placements/memory.py, the memory model: its byte counts checked against parameter counts
and each other, Hardware's headroom and on-paper refusals, and when an Estimate fits; on tiny configs and Wan 14B."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import ROOT, workload
from tests.placements.test_planner import estimates_for
from wandistiller.core.arch import TINY_TRANSFORMER
from wandistiller.core.errors import UserError
from wandistiller.placements import memory
from wandistiller.placements.memory import Estimate, GiB, Hardware, Workload, param_count, teacher_weight_bytes
from wandistiller.placements.offload import OffloadPlacement

TINY_STUDENT = TINY_TRANSFORMER | {"num_layers": 2}


def tiny_workload(**changes) -> Workload:
    """The planner's input for the tiny teacher and a 2-block student (bytes the tests can count exactly)."""
    w = Workload(
        teacher_config=dict(TINY_TRANSFORMER),
        experts=1,
        teacher_dtype_bytes=2,
        student_config=dict(TINY_STUDENT),
        batch_size=2,
        tokens=16,
        text_tokens=8,
        gradient_checkpointing=False,
        ema=False,
    )
    return replace(w, **changes)


def machine(gpus: int, gpu_bytes: int = 80 * GiB, host_bytes: int = 256 * GiB, **headroom) -> Hardware:
    """Hardware on paper: `gpus` GPUs of `gpu_bytes` free each."""
    return Hardware((gpu_bytes,) * gpus, host_bytes, **headroom)


def paper_hardware(**keys):
    """A `hardware` config node as the user writes it (None: detect this machine's)."""
    node = {"gpus": None, "gpu_memory_gib": None, "host_memory_gib": None, "headroom_gib": 0.0}
    return OmegaConf.create(node | {"headroom_fraction": memory.DEFAULT_HEADROOM_FRACTION} | keys)


def test_the_14b_expert_weighs_what_its_parameters_say(make_cfg):
    estimates, cfg = estimates_for(make_cfg, "wan2.1_t2v_14b", "1x80GiB")
    w, _ = workload(cfg)
    assert 14.2e9 < param_count(w.teacher_config) < 14.4e9  # Wan 14B
    assert abs(teacher_weight_bytes(w) / 1e9 - 28.6) < 0.1


def test_the_fitted_constants_are_the_ones_docs_planner_fit_json_records():
    fit = json.loads((ROOT / "docs" / "planner_fit.json").read_text())
    assert fit["fitted"]["ACT_FACTOR"] == memory.ACT_FACTOR
    assert tuple(fit["fitted"]["CPU_HEAP_PER_TOKEN"]) == memory.CPU_HEAP_PER_TOKEN
    assert fit["fitted"]["FIT_ERROR_PCT"] == memory.FIT_ERROR_PCT and fit["fitted"]["FIT_MARGIN"] == memory.FIT_MARGIN
    # Every fitted point lies in the target band: 0 to +15% over its measurement.
    assert all(0 <= p["error_pct"] <= 15 for p in fit["points"]), [p for p in fit["points"] if p["error_pct"] < 0]


def test_the_planner_sizes_the_teachers_activations_for_a_whole_step(make_cfg):
    common = ["teacher=wan2.1_t2v_14b", "data.latent_height=60", "data.latent_width=104", "student=small"]
    hardware = ["hardware.gpus=1", "hardware.gpu_memory_gib=24", "teacher_placement=offload"]
    streaming = {}
    for whole in ("false", "true"):
        cfg = make_cfg(*common, *hardware, "trainer.grad_accum_steps=8", f"trainer.teacher_whole_step={whole}")
        w, hw = workload(cfg)
        e = OffloadPlacement().estimate(w, hw)
        streaming[whole] = e.gpu_bytes[0] - e.resident_blocks * memory.block_bytes(w.teacher_config, 2)[1]
    act = memory.teacher_activation_bytes(replace(w, teacher_batch_size=0))
    assert memory.teacher_activation_bytes(w) == 8 * act  # 8 micro-batches in one teacher call
    # At 8x the batch the teacher's transient forward, not the student's backward, is the GPU's peak.
    teacher_phase = int((memory.student_state_bytes(w, grads=False) + 8 * act) * (1 + memory.FIT_MARGIN))
    assert memory.beside_teacher_bytes(w) == teacher_phase + memory.CUDA_CONTEXT
    assert streaming["true"] - streaming["false"] > 2 * act


def test_the_headroom_is_the_larger_of_its_size_and_its_fraction():
    by_size = Hardware((), 0, headroom_gib=10, headroom_fraction=0.05)
    by_fraction = Hardware((), 0, headroom_gib=10, headroom_fraction=0.25)
    assert by_size.headroom(100 * GiB) == 10 * GiB and by_size.usable(100 * GiB) == 90 * GiB
    assert by_fraction.headroom(100 * GiB) == 25 * GiB and by_fraction.usable(100 * GiB) == 75 * GiB


def test_hardware_on_paper_is_what_the_keys_say():
    hw = Hardware.detect(paper_hardware(gpus=2, gpu_memory_gib=40, host_memory_gib=64, headroom_gib=1.5))
    # /dev/shm on paper: Linux's default, half the RAM.
    assert hw == Hardware((40 * GiB, 40 * GiB), 64 * GiB, 1.5, memory.DEFAULT_HEADROOM_FRACTION, 32 * GiB)
    assert hw.describe() == "2 GPU(s) of 40 GiB free, 64 GiB host RAM available"
    assert Hardware.detect(paper_hardware(gpus=0, host_memory_gib=8)).gpu_bytes == ()


@pytest.mark.parametrize(
    "keys,named",
    [
        ({"gpus": 4}, "hardware.gpu_memory_gib"),
        ({"gpus": 0, "host_memory_gib": 8, "headroom_fraction": 1.0}, "hardware.headroom_fraction=1.0"),
        ({"gpus": 0, "host_memory_gib": 8, "headroom_gib": -1}, "hardware.headroom_gib=-1"),
        # A GPU's size beside no GPU count, or none: this machine was planned, without a word that it was.
        ({"gpus": 0, "gpu_memory_gib": 40}, "hardware.gpu_memory_gib=40 is one GPU's memory, but hardware.gpus=0"),
        ({"gpu_memory_gib": 40}, "hardware.gpu_memory_gib=40 plans GPUs on paper, and needs their count too"),
    ],
)
def test_hardware_keys_that_plan_nothing_are_refused_in_one_line_naming_the_key(keys, named):
    with pytest.raises(UserError, match=named) as refused:
        Hardware.detect(paper_hardware(**keys))
    assert "\n" not in str(refused.value)


def test_an_estimate_fits_only_when_every_device_keeps_its_headroom_and_says_when_headroom_alone_excludes_it():
    hw = machine(2, gpu_bytes=100 * GiB, host_bytes=100 * GiB, headroom_gib=10)
    assert Estimate.of("p", (90 * GiB, 90 * GiB), 90 * GiB, hw, "").fits
    by_headroom = Estimate.of("p", (50 * GiB, 95 * GiB), 10 * GiB, hw, "")
    assert not by_headroom.fits and by_headroom.headroom_excludes.startswith("needs 95.0 GiB on GPU 1, and 100.0")
    too_big = Estimate.of("p", (50 * GiB,), 101 * GiB, hw, "")  # over the memory itself: no headroom excuse
    assert not too_big.fits and too_big.headroom_excludes == ""
    assert too_big.need() == "50.0 GiB on its fullest GPU, 101.0 GiB host RAM"
    refused = Estimate.refused("p", "needs a GPU")
    assert (refused.fits, refused.gpu_bytes, refused.host_bytes, refused.note) == (False, (), 0, "needs a GPU")


def test_a_teachers_bytes_are_its_parameters_split_into_the_blocks_and_the_rest():
    w = tiny_workload(experts=2)
    outside, block = memory.block_bytes(w.teacher_config, 2)
    assert outside + TINY_TRANSFORMER["num_layers"] * block == 2 * param_count(TINY_TRANSFORMER)
    assert outside == 2 * param_count(TINY_TRANSFORMER | {"num_layers": 0}) and 0 < outside and 0 < block
    assert teacher_weight_bytes(w) == 2 * 2 * param_count(TINY_TRANSFORMER)  # two experts, two bytes each
    _, fp8_block = memory.block_bytes(w.teacher_config, 2, fp8=True)
    assert block / 2 < fp8_block < block  # one byte per Linear weight, plus a scale per row and the rest in bf16


def test_the_blocks_that_fit_are_what_is_left_after_the_rest_and_two_streaming_slots():
    outside, block = memory.block_bytes(TINY_TRANSFORMER, 2)
    slots = outside + 2 * block
    assert memory.blocks_that_fit(TINY_TRANSFORMER, 1, 2, slots + 3 * block) == 3
    assert memory.blocks_that_fit(TINY_TRANSFORMER, 2, 2, 2 * (slots + block)) == 1  # per expert
    assert memory.blocks_that_fit(TINY_TRANSFORMER, 1, 2, slots - 1) == 0
    assert memory.blocks_that_fit(TINY_TRANSFORMER, 1, 2, 100 * GiB) == TINY_TRANSFORMER["num_layers"]
    # Without a plan: 20% and 4 GiB of the free memory are left for the student.
    free = int((4 * GiB + slots + 2 * block) / 0.8) + 1
    assert memory.resident_blocks(TINY_TRANSFORMER, 1, torch.bfloat16, free) == 2


def test_the_students_activations_shrink_with_checkpointing_and_grow_on_the_cpu_and_with_the_batch():
    w = tiny_workload()
    gpu = memory.student_activation_bytes(w)
    assert memory.student_activation_bytes(replace(w, gradient_checkpointing=True)) < gpu
    assert memory.student_activation_bytes(replace(w, compiled=True)) < gpu  # the fitted factor of regional compile
    assert memory.student_activation_bytes(w, "cpu") > gpu  # glibc's heap per token
    assert memory.student_activation_bytes(replace(w, batch_size=4)) > gpu


def test_a_training_process_peaks_at_the_larger_of_its_two_phases_with_the_margin():
    w = tiny_workload(ema=True)
    assert memory.student_state_bytes(w) == param_count(TINY_STUDENT) * (12 + 4 + 4)
    assert memory.student_state_bytes(w, grads=False) == param_count(TINY_STUDENT) * (12 + 4)
    student = memory.student_state_bytes(w) + memory.student_activation_bytes(w)
    teacher = memory.student_state_bytes(w, grads=False) + memory.teacher_activation_bytes(w)
    assert memory.training_bytes(w) == int(max(student, teacher) * (1 + memory.FIT_MARGIN))
    assert memory.training_bytes(w, teacher_here=False) == int(student * (1 + memory.FIT_MARGIN))
    assert memory.student_device_bytes(w) == memory.training_bytes(w, teacher_here=False) + memory.CUDA_CONTEXT


def lora_fake(rank: int = 4) -> memory.OwnNetwork:
    """dmd's LoRA fake score as it declares it (method.fake_score=lora, 5 updates per step)."""
    return memory.OwnNetwork("fake score", "method.fake_score=lora", memory.ADAPTERS, rank=rank, forwards=1, trains=5)


def test_a_lora_fake_score_counts_its_adapters_states_and_a_teacher_sized_backward_as_a_third_phase():
    fake = lora_fake()
    w = tiny_workload(networks=(fake,), gradient_checkpointing=True)
    d, ffn, blocks = 32, 64, TINY_TRANSFORMER["num_layers"]
    adapters = 4 * (8 * (d + d) + 2 * (d + ffn)) * blocks  # rank x (8 attention projections, 2 FFN Linears)
    assert memory.network_params(w, fake) == adapters
    assert memory.network_params(replace(w, experts=2), fake) == 2 * adapters
    assert memory.method_state_bytes(w) == adapters * 12 and memory.method_state_bytes(w, fake) == adapters * 16
    # The teacher's backward on a resident teacher: not checkpointed whatever the student is, no 16-bit copies of
    # its 16-bit weights; plus the adapters' own saved inputs in every block.
    as_teacher = replace(w, student_config=w.teacher_config, ema=False, gradient_checkpointing=False)
    per_block = 32 * (14 * d + 2 * ffn) + 16 * 4 * d  # (batch 2 x 16) image and (2 x 8) text tokens
    factor = memory.ACT_FACTOR["gpu_adapted"]  # fitted to a LoRA student's backward through the teacher
    lora = int(factor * blocks * per_block)
    backward = memory.student_activation_bytes(as_teacher, weight_casts=False, factor=factor) + lora
    assert memory.network_activation_bytes(w, fake) == backward
    fp32 = replace(w, teacher_dtype_bytes=4)  # under autocast: the 16-bit copies of its weights too
    assert (
        memory.network_activation_bytes(fp32, fake)
        == memory.student_activation_bytes(as_teacher, factor=factor) + lora
        > backward
    )
    phases = [
        memory.student_state_bytes(w) + memory.student_activation_bytes(w) + adapters * 12,
        memory.student_state_bytes(w, grads=False) + memory.teacher_activation_bytes(w) + adapters * 12,
        memory.student_state_bytes(w, grads=False) + adapters * 16 + backward,
    ]
    assert memory.training_bytes(w) == int(max(phases) * (1 + memory.FIT_MARGIN))
    bigger_fake = memory.training_bytes(replace(w, networks=(lora_fake(64),)))  # the third phase: its adapters' states
    assert bigger_fake > memory.training_bytes(w)


def test_a_process_on_a_gpu_machine_adds_the_cuda_runtime_and_without_one_holds_the_student_in_ram():
    w, gpu, cpu = tiny_workload(), machine(1), machine(0)
    assert memory.host_process_bytes(gpu) - memory.host_process_bytes(cpu) == memory.HOST_CUDA
    assert memory.host_training_bytes(w, gpu) == memory.host_process_bytes(gpu) + memory.teacher_activation_bytes(w)
    assert memory.host_training_bytes(w, cpu) == memory.host_process_bytes(cpu) + memory.training_bytes(w, "cpu")


def test_a_streamed_teachers_backward_keeps_each_blocks_input_and_one_blocks_activations():
    # offload and disk recompute each block in backward (streaming.Recomputed), adapters as they were in the forward
    fake = lora_fake()
    w = tiny_workload(networks=(fake,))
    streamed = replace(w, teacher_checkpointed=True)
    d, ffn = 32, 64
    as_teacher = replace(w, student_config=w.teacher_config, gradient_checkpointing=True)
    factor = memory.ACT_FACTOR["gpu_adapted"]
    lora = int(factor * (32 * (14 * d + 2 * ffn) + 16 * 4 * d))  # one block's adapters
    teacher = memory.student_activation_bytes(as_teacher, weight_casts=False, factor=factor)
    assert memory.network_activation_bytes(streamed, fake) == teacher + lora
    assert memory.network_activation_bytes(streamed, fake) < memory.network_activation_bytes(w, fake)
    lora_student = replace(w, student_config=w.teacher_config, student_lora_rank=4)  # both phases adapted
    assert memory.training_bytes(replace(lora_student, teacher_checkpointed=True)) < memory.training_bytes(lora_student)


def test_a_lora_student_counts_its_adapters_states_and_a_backward_through_the_teacher_and_no_weights_of_its_own():
    teacher = dict(TINY_TRANSFORMER)
    w = tiny_workload(student_config=teacher, student_lora_rank=4, ema=True)
    d, ffn, blocks = 32, 64, teacher["num_layers"]
    adapters = 4 * (8 * (d + d) + 2 * (d + ffn)) * blocks
    assert memory.student_params(w) == adapters == memory.lora_params(w, 4)
    assert memory.student_state_bytes(w) == adapters * (12 + 4 + 4)  # fp32 A and B, AdamW, grads, EMA
    fake = replace(w, student_lora_rank=0, networks=(lora_fake(),))  # the same backward as a fake score's
    backward = memory.adapted_activation_bytes(w)
    assert memory.student_activation_bytes(w) == backward == memory.network_activation_bytes(fake, lora_fake())
    assert memory.student_activation_bytes(replace(w, teacher_checkpointed=True)) < memory.student_activation_bytes(w)
    assert memory.student_params(replace(w, experts=2)) == 2 * adapters  # a set on each expert
    student = memory.student_state_bytes(w) + memory.student_activation_bytes(w)
    teacher_phase = memory.student_state_bytes(w, grads=False) + memory.teacher_activation_bytes(w)
    assert memory.training_bytes(w) == int(max(student, teacher_phase) * (1 + memory.FIT_MARGIN))


def test_a_student_shaped_network_of_a_lora_student_is_a_second_adapter_set_not_a_copy_of_the_teacher():
    """dmd's `fake_score=student` beside `student=lora` is adapters of the student's rank and layers on the placed
    teacher (DMD.bind), so the planner counts those, and their backward through the teacher, never a teacher copy."""
    copy = memory.OwnNetwork("fake score", "method.fake_score=student", memory.STUDENT_SHAPED, forwards=1, trains=5)
    w = tiny_workload(student_config=dict(TINY_TRANSFORMER), student_lora_rank=4, networks=(copy,))
    assert memory.adapted(w, copy) and memory.network_params(w, copy) == memory.student_params(w)
    assert memory.network_params(w, copy) < param_count(w.teacher_config) // 4
    assert memory.network_activation_bytes(w, copy) == memory.adapted_activation_bytes(w)
    own = replace(w, student_config=dict(TINY_STUDENT), student_lora_rank=0)  # a student of its own: a copy of it
    assert not memory.adapted(own, copy) and memory.network_params(own, copy) == param_count(TINY_STUDENT)
    # A teacher-shaped network beside the LoRA student trains every weight of its own: a whole network's backward.
    shaped = memory.OwnNetwork("fake score", "method.fake_score=teacher", memory.TEACHER_SHAPED, trains=5)
    whole = replace(w, student_lora_rank=0, ema=False)
    assert memory.network_activation_bytes(w, shaped) == memory.student_activation_bytes(whole)
    assert memory.network_params(w, shaped) == param_count(w.teacher_config)
