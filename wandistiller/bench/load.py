"""`load`: host memory and seconds to load one expert from a diffusers folder (random weights, written
once to --folder), each way in a fresh process: diffusers' from_pretrained (what `cpu`/`gpu` do), and
the `offload` / `disk` streamed loaders. Peak RSS (VmHWM) includes memory-mapped file pages.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from wandistiller.bench.models import memory_gib, random_model
from wandistiller.placements.streaming import load_streamed_expert


def _load_once(how: str, folder: str, device: str) -> dict:
    """In a fresh process: load one expert `how`, and what that cost in host memory and time."""

    from diffusers import WanTransformer3DModel

    before = memory_gib()
    base = before["RssAnon"] + before["RssShmem"]
    peak_anon, done = [0.0], threading.Event()

    def sample() -> None:  # RAM that is not page cache has no high-water mark of its own: sample it
        while not done.wait(0.005):
            m = memory_gib()
            peak_anon[0] = max(peak_anon[0], m["RssAnon"] + m["RssShmem"] - base)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    try:  # a load that fails stops the sampler too: left running, it would keep its process from exiting
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
    finally:
        done.set()
        sampler.join()
    after = memory_gib()
    del model
    return {
        "how": how,
        "seconds": seconds,
        "peak_rss_gib": after["VmHWM"] - before["VmRSS"],
        "peak_anon_shmem_gib": peak_anon[0],
        "held_anon_shmem_gib": after["RssAnon"] + after["RssShmem"] - base,
    }


def load_bench(args) -> dict:

    folder = Path(args.folder).expanduser() / "transformer"
    if not (folder / "config.json").is_file():
        random_model(args.arch, torch.bfloat16).save_pretrained(folder, safe_serialization=True)
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
