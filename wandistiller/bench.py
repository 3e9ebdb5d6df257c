"""Benchmarks you run on purpose (never timed unit tests).

    python -m wandistiller.bench overhead [--steps 40] [--reps 5] [--out bench_overhead.json]
    python -m wandistiller.bench teacher --arch 14b --placement offload --batch 1,8 [--resident-blocks 0]
    python -m wandistiller.bench load --arch 1.3b [--folder ~/.cache/wandistiller/bench_1.3b]

`teacher`: ms per sample of a teacher forward (random weights, the chosen architecture, 1560 tokens =
one 480x832 frame, 512 text tokens) for a streamed placement against the GPU-resident model in the
same process, plus peak GPU memory and the copy floor (streamed bytes / pinned host->device bandwidth
measured in the same run).

`load`: host memory and seconds to load one expert from a diffusers folder (random weights, written
once to --folder), each way in a fresh process: diffusers' from_pretrained (what `cpu`/`gpu` do), and
the `offload` / `disk` streamed loaders. Peak RSS (VmHWM) includes memory-mapped file pages.

`overhead`: the framework's training loop against a hand-written loop doing the same arithmetic (the
same tiny teacher and student, guided targets, MSE, AdamW, clipping, LR schedule) in the same process,
interleaved, median of several repetitions after warm-up. Target: <= 1.10x.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from wandistiller.arch import BENCH_ARCHS


def _setup(cache_dir: Path, batch_size: int):
    from hydra import compose, initialize_config_dir

    from wandistiller.config import CONF_DIR, register_configs
    from wandistiller.data import encode_prompts, read_prompts
    from wandistiller.distributed import Topology
    from wandistiller.placements.cpu import CpuPlacement
    from wandistiller.precision import Precision
    from wandistiller.student import build_student
    from wandistiller.teacher import inspect_teacher, resolve_teacher_path

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(
            "train",
            overrides=[
                f"paths.cache_dir={cache_dir}",
                "paths.output_dir=/tmp/unused",
                "precision=fp32",
                f"trainer.batch_size={batch_size}",
                "logger=none",
            ],
        )
    precision = Precision.from_config(cfg.precision)
    spec = inspect_teacher(resolve_teacher_path(cfg.teacher, cfg.paths.cache_dir))
    teacher = CpuPlacement().load(spec, cfg.teacher, precision, Topology())
    embeddings = encode_prompts(
        spec, read_prompts(None), "", 512, precision.teacher_dtype, torch.device("cpu"), cache_dir
    )
    torch.manual_seed(0)
    student = build_student(spec, builder=cfg.student.builder, init="teacher")
    return cfg, spec, teacher, embeddings, student, precision


def framework_steps(cfg, spec, teacher, embeddings, student, precision, steps: int) -> float:
    """Seconds per step of wandistiller's own loop (no checkpoints, no tracker, no progress bar)."""
    from diffusers.optimization import get_scheduler

    from wandistiller.data import batch_source
    from wandistiller.loop import Run, train_loop
    from wandistiller.targets import LocalTargets
    from wandistiller.tracking import NullTracker

    trainer = OmegaConf.merge(cfg.trainer, {"max_steps": steps, "checkpoint_every": 10**9, "progress_bar": False})
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)
    shape = (16, cfg.data.latent_frames, cfg.data.latent_height, cfg.data.latent_width)
    batch_fn = batch_source(0, cfg.trainer.batch_size, shape, spec.flow_shift, 1000, embeddings)
    run = Run(
        model=student,
        targets=LocalTargets(teacher),
        batch_fn=batch_fn,
        optimizer=optimizer,
        lr_scheduler=get_scheduler("cosine", optimizer, num_warmup_steps=10, num_training_steps=steps),
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        ema=None,
        tracker=NullTracker(),
        precision=precision,
        device=torch.device("cpu"),
        run_dir=Path("/tmp/unused"),
        is_main=False,
    )
    start = time.perf_counter()
    train_loop(run, trainer, 0.0, 0)
    return (time.perf_counter() - start) / steps


def handwritten_steps(cfg, spec, teacher, embeddings, student, steps: int) -> float:
    """The same arithmetic written out by hand: what a minimal script would do."""
    from diffusers.optimization import get_scheduler

    expert, scale, b = teacher.experts[0], teacher.guidance_scales[0], cfg.trainer.batch_size
    shape = (b, 16, cfg.data.latent_frames, cfg.data.latent_height, cfg.data.latent_width)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=10, num_training_steps=steps)
    uncond = embeddings.negative_batch(b)
    start = time.perf_counter()
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        cond = embeddings.padded(torch.randint(len(embeddings.embeds), (b,), generator=g))
        x0, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        u = torch.rand(b, generator=g)
        sigma = 3.0 * u / (1 + 2.0 * u)
        s = sigma.view(-1, 1, 1, 1, 1)
        x_t, t = (1 - s) * x0 + s * noise, sigma * 1000
        with torch.no_grad():
            pred = expert(
                hidden_states=torch.cat([x_t, x_t]),
                timestep=torch.cat([t, t]),
                encoder_hidden_states=torch.cat([cond, uncond]),
                return_dict=False,
            )[0]
            c, un = pred.float().chunk(2)
            target = un + scale * (c - un)
        out, _ = student(x_t, t, cond)
        loss = F.mse_loss(out.float(), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss.item()
    return (time.perf_counter() - start) / steps


def overhead(args) -> dict:
    cfg, spec, teacher, embeddings, student, precision = _setup(Path(args.cache_dir).expanduser(), args.batch_size)
    framework_steps(cfg, spec, teacher, embeddings, student, precision, 5)  # warm-up both paths
    handwritten_steps(cfg, spec, teacher, embeddings, student, 5)
    ours, theirs = [], []
    for _ in range(args.reps):  # interleaved, so drift hits both alike
        ours.append(framework_steps(cfg, spec, teacher, embeddings, student, precision, args.steps))
        theirs.append(handwritten_steps(cfg, spec, teacher, embeddings, student, args.steps))
    result = {
        "benchmark": "overhead",
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "batch_size": args.batch_size,
        "steps": args.steps,
        "reps": args.reps,
        "framework_ms_per_step": 1e3 * statistics.median(ours),
        "handwritten_ms_per_step": 1e3 * statistics.median(theirs),
        "ratio": statistics.median(ours) / statistics.median(theirs),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(
        f"{'loop':<14}{'ms/step (median)':>18}\n{'wandistiller':<14}{result['framework_ms_per_step']:>18.2f}\n"
        f"{'hand-written':<14}{result['handwritten_ms_per_step']:>18.2f}\nratio {result['ratio']:.3f}x "
        f"(target <= 1.10x)"
    )
    return result


ARCHS = BENCH_ARCHS


def _random_model(arch: str, dtype: torch.dtype):
    """A Wan transformer of that shape with random weights, built on the CPU without a slow init."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    from wandistiller.streaming import replace_tensor

    with init_empty_weights():  # parameters on meta; buffers (rope tables) real
        model = WanTransformer3DModel(**ARCHS[arch])
    g = torch.Generator().manual_seed(0)
    for name, p in list(model.named_parameters()):
        replace_tensor(model, name, (torch.randn(p.shape, generator=g) * 0.02).to(dtype))
    return model.eval().requires_grad_(False)


def _time_forward(model, inputs, device, reps: int) -> float:
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


def _pinned_bandwidth(device: torch.device) -> float | None:
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


def _inputs(b: int, args, config: dict, device: torch.device, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(b)  # never all-zero inputs
    shape = (b, 16, 1, args.latent_height, args.latent_width)
    return dict(
        hidden_states=torch.randn(shape, generator=g).to(device, dtype),
        timestep=(torch.rand(b, generator=g) * 1000).to(device),
        encoder_hidden_states=torch.randn(b, 512, config["text_dim"], generator=g).to(device, dtype),
        return_dict=False,
    )


def forward_flops(config: dict, batch: int, tokens: int, text_tokens: int = 512) -> float:
    """Matmul FLOPs of one forward (as ../shared/gpu_baseline.py counts them): projections, attention, FFN."""
    d, f = config["num_attention_heads"] * config["attention_head_dim"], config["ffn_dim"]
    L, T = tokens, text_tokens
    per_layer = 12 * L * d * d + 4 * T * d * d + 4 * L * L * d + 4 * L * T * d + 4 * L * d * f
    return batch * config["num_layers"] * per_layer


@torch.no_grad()
def teacher_bench(args) -> dict:
    import copy

    from wandistiller.memory import block_bytes
    from wandistiller.streaming import stream_blocks
    from wandistiller.teacher import compile_blocks

    device = torch.device(args.device)
    dtype = torch.bfloat16
    host_model = _random_model(args.arch, dtype)
    config = dict(host_model.config)
    outside, block = block_bytes(config, 2)
    bandwidth = _pinned_bandwidth(device)
    batches = [int(x) for x in args.batch.split(",")]
    inputs = {b: _inputs(b, args, config, device, dtype) for b in batches}

    def peak() -> float | None:
        return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None

    resident, measured = copy.deepcopy(host_model).to(device), {}
    if args.compile:  # the same regional compile for both, so the ratio compares like with like
        compile_blocks(resident)
    for b in batches:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = _time_forward(resident, inputs[b], device, args.reps)
        measured[b] = (seconds, peak(), resident(**inputs[b])[0].float().cpu())
    del resident
    if device.type == "cuda":
        torch.cuda.empty_cache()
    kept = args.resident_blocks
    if kept == "auto":  # what the offload placement keeps: as many blocks as the free memory holds
        from wandistiller.memory import resident_blocks

        kept = resident_blocks(config, 1, dtype, torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else 0
    kept = int(kept)
    streamed_bytes = (config["num_layers"] - kept) * block
    stream_blocks(host_model, device, "host", kept)  # in place: one pinned buffer, two device slots
    if args.compile:
        compile_blocks(host_model)
    host_rss = _memory_gib()["VmRSS"]  # the pinned blocks, plus what the benchmark itself keeps
    tokens = args.latent_height * args.latent_width // 4
    rows = []
    for b in batches:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = _time_forward(host_model, inputs[b], device, args.reps)
        resident_s, resident_peak, reference = measured[b]
        floor = streamed_bytes / bandwidth if bandwidth else None
        rows.append(
            {
                "batch": b,
                "resident_ms_per_sample": 1e3 * resident_s / b,
                "offload_ms_per_sample": 1e3 * seconds / b,
                "ratio_vs_resident": seconds / resident_s,
                "copy_floor_ms": 1e3 * floor if floor else None,
                "ratio_vs_copy_floor": seconds / floor if floor else None,
                "resident_mfu_vs_989": forward_flops(config, b, tokens) / resident_s / 989e12,
                "offload_mfu_vs_989": forward_flops(config, b, tokens) / seconds / 989e12,
                "resident_peak_gib": resident_peak,
                "offload_peak_gib": peak(),
                "bit_identical": torch.equal(host_model(**inputs[b])[0].float().cpu(), reference),
            }
        )
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(
        f"teacher {args.arch}, {tokens} tokens, bf16{', compiled' if args.compile else ''}, {device_name}; "
        f"streams {streamed_bytes / 1e9:.1f} GB ({kept} blocks resident); pinned H2D "
        f"{(bandwidth or 0) / 1e9:.1f} GB/s; host RSS {host_rss:.1f} GiB"
    )
    print(
        f"{'batch':>5} {'resident ms/s':>14} {'MFU':>5} {'offload ms/s':>13} {'x resident':>10} {'x floor':>8} "
        f"{'peak GiB':>9} same"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['resident_ms_per_sample']:>14.1f} {r['resident_mfu_vs_989']:>5.0%} "
            f"{r['offload_ms_per_sample']:>13.1f} "
            f"{r['ratio_vs_resident']:>10.3f} {r['ratio_vs_copy_floor'] or 0:>8.3f} {r['offload_peak_gib'] or 0:>9.2f} "
            f"{r['bit_identical']}"
        )
    return {
        "benchmark": "teacher",
        "arch": args.arch,
        "compiled": args.compile,
        "device": device_name,
        "date": time.strftime("%Y-%m-%d"),
        "pinned_h2d_bytes_per_s": bandwidth,
        "streamed_bytes": streamed_bytes,
        "resident_blocks": kept,
        "host_rss_gib": host_rss,
        "rows": rows,
    }


def _memory_gib() -> dict[str, float]:
    """This process's host memory now (VmRSS: pinned buffers included) and its peak (VmHWM), in GiB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
            fields[key] = int(value.split()[0]) / 2**20
    return fields


def _load_once(how: str, folder: str, device: str) -> dict:
    """In a fresh process: load one expert `how`, and what that cost in host memory and time."""
    import threading

    from diffusers import WanTransformer3DModel

    from wandistiller.streaming import load_streamed_expert

    before = _memory_gib()
    base = before["RssAnon"] + before["RssShmem"]
    peak_anon, done = [0.0], threading.Event()

    def sample() -> None:  # RAM that is not page cache has no high-water mark of its own: sample it
        while not done.wait(0.005):
            m = _memory_gib()
            peak_anon[0] = max(peak_anon[0], m["RssAnon"] + m["RssShmem"] - base)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    if how == "from_pretrained":
        path = Path(folder)
        model = WanTransformer3DModel.from_pretrained(
            path.parent, subfolder=path.name, dtype=torch.bfloat16, use_safetensors=True
        ).to(device)
        for p in model.parameters():  # safetensors maps the files lazily: read every weight once, as a forward will
            p.sum()
    else:
        model, _ = load_streamed_expert(Path(folder), torch.bfloat16, torch.device(device), how, resident_blocks=0)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    after = _memory_gib()
    del model
    return {
        "how": how,
        "seconds": seconds,
        "peak_rss_gib": after["VmHWM"] - before["VmRSS"],
        "peak_anon_shmem_gib": peak_anon[0],
        "held_anon_shmem_gib": after["RssAnon"] + after["RssShmem"] - base,
    }


def load_bench(args) -> dict:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    folder = Path(args.folder).expanduser() / "transformer"
    if not (folder / "config.json").is_file():
        _random_model(args.arch, torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    stored = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**30
    rows = []
    for how in ("from_pretrained", "host", "disk"):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows.append(pool.submit(_load_once, how, str(folder), args.device).result())
    print(f"one {args.arch} expert, bf16, {stored:.2f} GiB stored, device {args.device}")
    print(f"{'loader':<16}{'seconds':>9}{'peak RSS GiB':>14}{'peak anon+shm':>15}{'held anon+shm':>15}")
    for r in rows:
        name = {"host": "offload", "disk": "disk"}.get(r["how"], r["how"])
        print(
            f"{name:<16}{r['seconds']:>9.1f}{r['peak_rss_gib']:>14.2f}{r['peak_anon_shmem_gib']:>15.2f}"
            f"{r['held_anon_shmem_gib']:>15.2f}"
        )
    return {
        "benchmark": "load",
        "arch": args.arch,
        "stored_gib": stored,
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m wandistiller.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="bench", required=True)
    p = sub.add_parser("overhead", help="framework loop vs a hand-written loop on the tiny CPU default")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--cache-dir", default="~/.cache/wandistiller")
    p.add_argument("--out", default="bench_overhead.json")
    t = sub.add_parser("teacher", help="a streamed teacher forward vs the GPU-resident one (random weights)")
    t.add_argument("--arch", choices=sorted(ARCHS), default="14b")
    t.add_argument("--placement", choices=["offload"], default="offload")
    t.add_argument("--batch", default="1,8")
    t.add_argument("--resident-blocks", default="0", help="blocks kept on the device: a count, or auto")
    t.add_argument("--latent-height", type=int, default=60)
    t.add_argument("--latent-width", type=int, default=104)
    t.add_argument("--reps", type=int, default=5)
    t.add_argument("--compile", action="store_true", help="regional torch.compile for both (compile_blocks)")
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--out", default="bench_teacher.json")
    ld = sub.add_parser("load", help="host memory and time to load one expert, each loader in a fresh process")
    ld.add_argument("--arch", choices=sorted(ARCHS), default="1.3b")
    ld.add_argument("--folder", default="~/.cache/wandistiller/bench_1.3b")
    ld.add_argument("--device", default="cpu")
    ld.add_argument("--out", default="bench_load.json")
    args = parser.parse_args()
    result = {"overhead": overhead, "teacher": teacher_bench, "load": load_bench}[args.bench](args)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
