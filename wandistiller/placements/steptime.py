"""The planner's step time: what one training step runs (each network's passes, a method's own included: dmd's
few-step generations and fake score), its matmul FLOPs, and the rate of the device that runs them.

Rough by design, and printed as such: compute at one effective rate per device kind (the GPU's fitted to one
H200 datum, so it is an H200's), a streamed teacher's copies overlapped with its compute (the streamer copies one
block ahead), a served teacher's calls for every rank it serves. Not modelled: collectives (sharded's gathers,
DDP's all-reduce), device-map hops, the optimizer step, data loading, compile's speed-up, fp8's faster matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

from wandistiller.placements.base import Placement, Serving
from wandistiller.placements.memory import (
    Estimate,
    Hardware,
    OwnNetwork,
    Workload,
    adapted,
    block_bytes,
    network_config,
)

# fitted: the effective rate that gives the one measured whole job: a 1.3B-shaped teacher into student=small, batch
# 16 x 1560 tokens, teacher_placement=gpu, bf16 eager, 26.6 samples/s on an H200 (scripts/gpu_figures.sh step 5's
# datum; tests/test_plan.py checks the model gives it back).
GPU_FLOPS = 2.99e14
# measured: bf16 matmuls at a training step's row counts on the 2-core dev VM (~41 GFLOP/s: docs/PERFORMANCE.md's fp8
# table, 1536x1536 and 1536x8960 at M=3120); a server's CPU is faster by its cores.
CPU_FLOPS = 4.0e10


def forward_flops(config: dict, batch: int, tokens: int, text_tokens: int = 512) -> float:
    """Matmul FLOPs of one forward: projections, attention, FFN (counted as the GPU reference benchmark counts them)."""
    d, f = config["num_attention_heads"] * config["attention_head_dim"], config["ffn_dim"]
    L, T = tokens, text_tokens
    per_layer = 12 * L * d * d + 4 * T * d * d + 4 * L * L * d + 4 * L * T * d + 4 * L * d * f
    return batch * config["num_layers"] * per_layer


@dataclass(frozen=True)
class Passes:
    """One training step of one rank in passes of each network, each at the micro-batch (`trains`: forward +
    backward; teacher calls: cond + uncond as one forward of twice the batch). Fractions are averages. Each
    method declares its own (`Method.passes`): the planner knows no method by name."""

    method: str
    micro_batches: int
    teacher_calls: int
    student_forwards: float  # without grad
    student_trains: int
    # The networks the method trains beside the student (dmd's fake score), each with its passes of this step.
    networks: tuple[OwnNetwork, ...] = ()

    def describe(self) -> str:
        def n(x: float) -> str:
            return f"{x:g}"

        parts = [
            f"{n(self.teacher_calls)} teacher call(s) (cond + uncond)"
            if self.teacher_calls
            else "no teacher call (its ODE is sampled once before training: not in the step)"
        ]
        parts.append(f"{n(self.student_trains)} student forward + backward")
        if self.student_forwards:
            parts.append(f"{n(self.student_forwards)} student forwards without grad (few-step generations)")
        for net in self.networks:
            parts.append(f"{n(net.trains)} {net.name} forward + backward, {n(net.forwards)} without grad")
        return f"a step of method={self.method}: " + ", ".join(parts)


@dataclass(frozen=True)
class StepTime:
    seconds: float  # one training step of every training rank
    teacher_seconds: float  # of it, the teacher's calls (pipelined beside the students under a dedicated owner)
    samples_per_s: float  # per node: every training rank's micro-batches


def training_seconds(p: Placement, e: Estimate, w: Workload, hw: Hardware, passes: Passes) -> float:
    """One rank's step on its training device: the student's passes and the method's network's. A network of its
    own computes at the device's rate; adapters on the placed teacher (student=lora, method.fake_score=lora) run
    the teacher's passes, which a streamed placement (`Placement.streamed_from`) also streams: a forward once, a
    training pass twice (its forward, then each block again for its recomputation and backward), each overlapped
    with that compute."""
    rate = GPU_FLOPS if hw.gpu_bytes else CPU_FLOPS
    streamed = p.streamed_from is not None

    def network(config: dict, adapted: bool, forwards: float, trains: float) -> float:
        flops = forward_flops(config, w.batch_size, w.tokens, w.text_tokens) / rate
        if not adapted:  # backward ~ 2 forwards; checkpointing recomputes the forward
            return flops * (forwards + (3 + w.gradient_checkpointing) * trains)
        if not streamed:  # a resident teacher: not checkpointed
            return flops * (forwards + 3 * trains)
        copies = streamed_copy_seconds(p, e, w, w.batch_size)
        return forwards * max(flops, copies) + trains * (max(flops, copies) + max(3 * flops, copies))

    seconds = network(w.student_config, w.student_lora_rank > 0, passes.student_forwards, passes.student_trains)
    for n in w.networks:  # the workload's: the networks its memory was planned for, timed with the same passes
        seconds += network(network_config(w, n), adapted(w, n), n.forwards, n.trains)
    return seconds


def streamed_copy_seconds(p: Placement, e: Estimate, w: Workload, batch: int) -> float:
    """A streamed teacher's copies of the blocks it does not keep, for one pass at `batch` (each expert it uses)."""
    _, block = block_bytes(w.teacher_config, w.teacher_dtype_bytes, w.teacher_fp8)
    streamed = w.teacher_config["num_layers"] - (e.resident_blocks or 0)
    assert p.streamed_from is not None  # called for streamed placements alone
    return min(w.experts, batch) * streamed * block / p.streamed_from


def teacher_call_seconds(p: Placement, e: Estimate, w: Workload, hw: Hardware) -> float:
    """One guided call (cond + uncond: twice the batch) where the placement computes it; a streamed teacher
    takes the longer of its compute and its copies of the blocks it does not keep (each expert the batch uses)."""
    batch = w.teacher_batch_size or w.batch_size
    on_gpu = bool(hw.gpu_bytes) and not p.teacher_on_cpu and not p.debug_cpu
    compute = forward_flops(w.teacher_config, 2 * batch, w.tokens, w.text_tokens) / (GPU_FLOPS if on_gpu else CPU_FLOPS)
    if p.streamed_from is None:
        return compute
    return max(compute, streamed_copy_seconds(p, e, w, batch))


def step_time(p: Placement, e: Estimate, w: Workload, hw: Hardware, passes: Passes) -> StepTime | None:
    """The placement's step: the training rank's passes, and the teacher's calls for every rank it serves --
    after them (its own, or a node owner's), or beside them (a dedicated owner computes step k+1's targets while
    the students train step k). None for a refused placement."""
    if not (e.gpu_bytes or e.host_bytes):
        return None
    ranks = max(w.ranks_per_node, 1)
    trainers = max(ranks - 1, 1) if p.serving == Serving.DEDICATED_OWNER else ranks
    served = 1 if p.serving == Serving.LOCAL else trainers
    train = training_seconds(p, e, w, hw, passes)
    teacher = passes.teacher_calls * served * teacher_call_seconds(p, e, w, hw) if passes.teacher_calls else 0.0
    seconds = max(train, teacher) if p.serving == Serving.DEDICATED_OWNER else train + teacher
    return StepTime(seconds, teacher, w.batch_size * passes.micro_batches * trainers / seconds)
