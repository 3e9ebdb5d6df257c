"""What the benchmarks share: Wan architectures, random-weight models, timing and memory helpers."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from wandistiller.core.arch import BENCH_ARCHS
from wandistiller.placements.steptime import forward_flops  # noqa: F401 -- the benchmarks' MFU, the planner's one count
from wandistiller.placements.streaming import replace_tensor

ARCHS = BENCH_ARCHS


def model_config(arch: str) -> dict:
    """The full WanTransformer3DModel config of an architecture (defaults filled in), without weights."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    with init_empty_weights():
        return dict(WanTransformer3DModel(**ARCHS[arch]).config)


def random_model(arch: str, dtype: torch.dtype):
    """A Wan transformer of that shape with random weights, built on the CPU without a slow init.

    Every weight is a slice of one seeded pool of normal values (x0.02; 2**27 of them, or as many as the
    largest weight holds: a 14B expert's FFN has 157M), at an offset set by its index: the same model on
    every call, in the time of a memory copy (a 14B expert in seconds, where drawing 14e9 values took
    minutes), so each benchmark process can build its own. Never all zeros.
    """
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    with init_empty_weights():  # parameters on meta; buffers (rope tables) real
        model = WanTransformer3DModel(**ARCHS[arch])
    pool = (torch.randn(pool_size(model), generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
    for i, (name, p) in enumerate(list(model.named_parameters())):
        start = (i * 1_000_003) % (pool.numel() - p.numel() + 1)
        replace_tensor(model, name, pool[start : start + p.numel()].clone().view(p.shape))
    return model.eval().requires_grad_(False)


def pool_size(model: torch.nn.Module) -> int:
    """How many random values `random_model` draws: 2**27, or the largest weight's size where that is larger."""
    return max(2**27, *(p.numel() for p in model.parameters()))


def time_forward(model, inputs, device, reps: int) -> float:
    for _ in range(2):
        model(**inputs)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        model(**inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pinned_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    src = torch.empty(2**30, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return 5 * src.numel() / (time.perf_counter() - start)


def forward_inputs(b: int, args, config: dict, device: torch.device, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(b)  # never all-zero inputs
    shape = (b, 16, 1, args.latent_height, args.latent_width)
    return dict(
        hidden_states=torch.randn(shape, generator=g).to(device, dtype),
        timestep=(torch.rand(b, generator=g) * 1000).to(device),
        encoder_hidden_states=torch.randn(b, 512, config["text_dim"], generator=g).to(device, dtype),
        return_dict=False,
    )


def memory_gib() -> dict[str, float]:
    """This process's host memory now (VmRSS: pinned buffers included) and its peak (VmHWM), in GiB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
            fields[key] = int(value.split()[0]) / 2**20
    return fields
