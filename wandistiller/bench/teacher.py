"""`teacher`: ms per sample of a teacher forward (random weights, the chosen architecture, 1560 tokens =
one 480x832 frame, 512 text tokens) for a streamed placement against the GPU-resident model, plus peak GPU
memory and the copy floor (streamed bytes / pinned host->device bandwidth measured in the same run).

The resident and the streamed model are each measured in a fresh process of their own (each builds the
same random weights, quickly: models.random_model). Measured in one process, the compiled resident model
outlived `del`: `compile_blocks` stores each block's compiled forward on the block, a reference cycle
that only the cyclic garbage collector frees, so
the whole resident model (26 GiB for a 14B expert) was still allocated -- and counted in the streamed
model's peak (28.2 GiB reported instead of ~3.2).
"""

from __future__ import annotations

import multiprocessing
import platform
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from wandistiller.bench.models import (
    forward_flops,
    forward_inputs,
    memory_gib,
    model_config,
    pinned_bandwidth,
    random_model,
    time_forward,
)
from wandistiller.placements.memory import block_bytes, resident_blocks
from wandistiller.placements.streaming import stream_blocks
from wandistiller.teacher.fastpaths import quantize_expert
from wandistiller.teacher.fp8 import relative_mse
from wandistiller.teacher.model import compile_blocks


def _in_fresh_process(fn, *args):
    """fn(*args) in a fresh (spawned) process: its CUDA context, allocator and compile caches die with it."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _peak(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


@torch.no_grad()
def _measure(args, batches: list[int], streamed: bool, quantize: str | None = None) -> dict:
    """Seconds per forward, peak GiB and the outputs, per batch, of the resident or the streamed model
    (bf16, or with `quantize="fp8"` its blocks' Linear layers in fp8, quantized before anything moves)."""

    device, dtype = torch.device(args.device), torch.bfloat16
    model = random_model(args.arch, dtype)  # the same weights in every process
    if quantize:  # the arithmetic on the device (seconds for a 14B expert), the bytes where the model lies
        quantize_expert(model, quantize, args.fp8_compute, device, work_device=device)
    config, kept = dict(model.config), args.resident_blocks
    if streamed:
        if kept == "auto":  # what the offload placement keeps: as many blocks as the free memory holds
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
            kept = resident_blocks(config, 1, dtype, free, bool(quantize)) if free else 0
        stream_blocks(model, device, "host", int(kept))  # in place: one pinned buffer, two device slots
    else:
        model = model.to(device)
    if args.compile:  # the same regional compile for both, so the ratio compares like with like
        compile_blocks(model)
    inputs = {b: forward_inputs(b, args, config, device, dtype) for b in batches}
    result: dict = {"kept": int(kept) if streamed else None, "host_rss_gib": memory_gib()["VmRSS"], "bandwidth": None}
    if streamed:
        result["bandwidth"] = pinned_bandwidth(device)
    for b in batches:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        seconds = time_forward(model, inputs[b], device, args.reps)
        result[b] = (seconds, _peak(device), model(**inputs[b])[0].float().cpu())
    return result


def teacher_bench(args) -> dict:

    config = model_config(args.arch)  # weights are built in each measuring process
    fp8 = args.quantize == "fp8"
    block, bf16_block = block_bytes(config, 2, fp8)[1], block_bytes(config, 2)[1]
    batches = [int(x) for x in args.batch.split(",")]
    bf16 = _in_fresh_process(_measure, args, batches, False) if fp8 else None  # the precision reference
    resident = _in_fresh_process(_measure, args, batches, False, args.quantize)
    streamed = _in_fresh_process(_measure, args, batches, True, args.quantize)
    kept, bandwidth = streamed["kept"], streamed["bandwidth"]
    streamed_bytes = (config["num_layers"] - kept) * block
    tokens = args.latent_height * args.latent_width // 4
    floor = streamed_bytes / bandwidth if bandwidth else None
    bf16_floor = (config["num_layers"] - kept) * bf16_block / bandwidth if bandwidth else None
    rows = [_row(b, resident[b], streamed[b], floor, config, tokens) for b in batches]
    if fp8:
        assert bf16 is not None  # measured above for fp8
        for r, b in zip(rows, batches):
            r |= _fp8_columns(b, bf16[b], resident[b], streamed[b], bf16_floor)
    cpu = platform.processor() or platform.machine()  # processor() is "" on many Linux machines
    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else cpu
    dtype_name = f"fp8 ({args.fp8_compute})" if fp8 else "bf16"
    print(
        f"teacher {args.arch}, {tokens} tokens, {dtype_name}{', compiled' if args.compile else ''}, {device_name}; "
        f"streams {streamed_bytes / 1e9:.1f} GB ({kept} blocks resident); pinned H2D "
        f"{(bandwidth or 0) / 1e9:.1f} GB/s; host RSS {streamed['host_rss_gib']:.1f} GiB; each in its own process"
    )
    print(
        f"{'batch':>5} {'resident ms/s':>14} {'MFU':>5} {'offload ms/s':>13} {'x resident':>10} {'x floor':>8} "
        f"{'res. GiB':>9} {'peak GiB':>9} same"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['resident_ms_per_sample']:>14.1f} {r['resident_mfu_vs_989']:>5.0%} "
            f"{r['offload_ms_per_sample']:>13.1f} {r['ratio_vs_resident']:>10.3f} "
            f"{r['ratio_vs_copy_floor'] or 0:>8.3f} "
            f"{r['resident_peak_gib'] or 0:>9.2f} {r['offload_peak_gib'] or 0:>9.2f} {r['bit_identical']}"
        )
    if fp8:
        _print_fp8(rows)
    return {
        "benchmark": "teacher",
        "arch": args.arch,
        "compiled": args.compile,
        "quantize": args.quantize,
        "fp8_compute": args.fp8_compute if fp8 else None,
        "bf16_copy_floor_bytes": (config["num_layers"] - kept) * bf16_block,
        "device": device_name,
        "date": time.strftime("%Y-%m-%d"),
        "pinned_h2d_bytes_per_s": bandwidth,
        "streamed_bytes": streamed_bytes,
        "resident_blocks": kept,
        "host_rss_gib": streamed["host_rss_gib"],
        "measured_in": "one forked process per model",
        "rows": rows,
    }


def _row(b: int, resident: tuple, streamed: tuple, floor: float | None, config: dict, tokens: int) -> dict:
    (resident_s, resident_peak, reference), (seconds, peak, output) = resident, streamed
    return {
        "batch": b,
        "resident_ms_per_sample": 1e3 * resident_s / b,
        "offload_ms_per_sample": 1e3 * seconds / b,
        "ratio_vs_resident": seconds / resident_s,
        "copy_floor_ms": 1e3 * floor if floor else None,
        "ratio_vs_copy_floor": seconds / floor if floor else None,
        "resident_mfu_vs_989": forward_flops(config, b, tokens) / resident_s / 989e12,
        "offload_mfu_vs_989": forward_flops(config, b, tokens) / seconds / 989e12,
        "resident_peak_gib": resident_peak,
        "offload_peak_gib": peak,
        "bit_identical": torch.equal(output, reference),
    }


def _fp8_columns(b: int, bf16: tuple, resident: tuple, streamed: tuple, bf16_floor: float | None) -> dict:
    """fp8 against bf16: speed (resident), precision (targets' relative MSE, held to <= 1%), and the
    streamed fp8 forward against the bf16 copy floor (target: <= 0.6x)."""

    return {
        "bf16_resident_ms_per_sample": 1e3 * bf16[0] / b,
        "fp8_vs_bf16_resident": resident[0] / bf16[0],
        "rel_mse_vs_bf16": relative_mse(resident[2], bf16[2]),
        "streamed_rel_mse_vs_bf16": relative_mse(streamed[2], bf16[2]),
        "offload_vs_bf16_copy_floor": streamed[0] / bf16_floor if bf16_floor else None,
    }


def _print_fp8(rows: list[dict]) -> None:
    print(f"{'batch':>5} {'bf16 res. ms/s':>15} {'fp8 x bf16':>10} {'rel. MSE':>9} {'offload x bf16 floor':>21}")
    for r in rows:
        floor = r["offload_vs_bf16_copy_floor"]
        print(
            f"{r['batch']:>5} {r['bf16_resident_ms_per_sample']:>15.1f} {r['fp8_vs_bf16_resident']:>10.3f} "
            f"{r['rel_mse_vs_bf16']:>9.2e} {floor if floor is not None else float('nan'):>21.3f}"
        )
