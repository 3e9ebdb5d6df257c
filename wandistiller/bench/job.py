"""`job`: the whole job at real shapes against a hand-written loop doing the same arithmetic, in one invocation.

Builds once (cached under --cache-dir) a diffusers Wan folder whose transformer has the chosen real shape
with random weights -- the tiny teacher's builder with a transformer override: a 4096-wide small text
encoder, a tiny VAE, the tokenizer and scheduler -- then runs `python -m wandistiller.train` on it (a
subprocess; its metrics_steps.jsonl gives the times) and `handwritten.py`'s loop in this process. Both are
timed the same way (CUDA events around each step after --warmup steps; perf_counter on a CPU), and both
log the loss at the same steps, so the ratio compares the loops, not their logging.

    python -m wandistiller.bench job --arch 1.3b --device cuda --batch 16 [--compile] [--placement gpu|offload]
        [--compile-mode reduce-overhead] [--quantize fp8] [--attention-backend flash]
    python -m wandistiller.bench job --arch tiny --device cpu --batch 2 --steps 6 --warmup 2   # the smoke test
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from wandistiller.bench import CACHE, handwritten, out_path
from wandistiller.bench.models import ARCHS
from wandistiller.teacher.tiny import ensure_tiny_teacher

REAL = {"freq_dim": 256, "rope_max_seq_len": 1024}  # Wan's own; the tiny builder's defaults are smaller


def teacher_folder(arch: str, cache_dir: str) -> Path:

    config = ARCHS[arch] | ({} if arch == "tiny" else REAL)
    return ensure_tiny_teacher(Path(cache_dir).expanduser() / "bench" / f"wan-{arch}", transformer_config=config)


def job_overrides(args, folder: Path, run_dir: Path) -> list[str]:
    """`python -m wandistiller.train` overrides for the same job the hand-written loop runs."""
    placement = args.placement if args.device.startswith("cuda") else "cpu"
    overrides = [
        f"teacher.path={folder}",
        "teacher.builtin=null",
        f"teacher.name=bench-{args.arch}",
        f"teacher_placement={placement}",
        f"student={args.student}",
        f"precision={args.precision}",
        f"trainer.batch_size={args.batch}",
        f"trainer.max_steps={args.steps}",
        f"trainer.checkpoint_every={args.steps}",
        f"trainer.log_every={args.log_every}",
        "hooks.samples.prompts=0",
        "hooks.monitor.val_every=0",  # the hand-written loop validates and evaluates nothing
        "~hooks.evaluate",
        "trainer.progress_bar=false",
        f"data.latent_height={args.latent_height}",
        f"data.latent_width={args.latent_width}",
        f"paths.cache_dir={Path(args.cache_dir).expanduser()}",
        f"seed={args.seed}",
        "logger=none",
        f"hydra.run.dir={run_dir}",
    ]
    if args.compile:
        overrides += ["teacher.compile=true", "trainer.compile_student=true"]
    for key, value in [
        ("trainer.compile_mode", args.compile_mode),
        ("teacher.quantize", args.quantize),
        ("teacher.attention_backend", args.attention_backend),
    ]:
        if value:
            overrides.append(f"{key}={value}")
    return overrides + list(args.set)


def framework_job(args, folder: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="wandistiller-bench-job-")) / "run"
    cmd = [sys.executable, "-m", "wandistiller.train", *job_overrides(args, folder, run_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    if done.returncode != 0:
        raise RuntimeError(f"the train job failed ({done.returncode}):\n{done.stderr[-3000:]}")
    steps = [json.loads(line) for line in (run_dir / "metrics_steps.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "metrics.json").read_text())
    timed = [s for s in steps if s["step"] > args.warmup]
    peaks = [v for s in timed for k, v in s.items() if k.startswith("gpu") and k.endswith("_peak_gib")]
    return {
        "samples_per_s": len(timed) * args.batch / (sum(s["step_ms"] for s in timed) / 1e3),
        "step_ms_median": statistics.median(s["step_ms"] for s in timed),
        "teacher_ms_median": statistics.median(s["teacher_ms"] for s in timed),
        "student_ms_median": statistics.median(s["student_ms"] for s in timed),
        "peak_gib": max(peaks) if peaks else None,
        "loss_last": steps[-1]["loss"],
        "losses": {s["step"]: s["loss"] for s in steps if s["step"] % args.log_every == 0 or s is steps[-1]},
        "wall_s": summary["wall_s"],
        "run_dir": str(run_dir),
    }


def job_bench(args) -> dict:
    _defaults(args)
    folder = teacher_folder(args.arch, args.cache_dir)
    framework = framework_job(args, folder)
    theirs = None if args.framework_only else handwritten.run_loop(args, handwritten.setup(args, folder))
    cpu = platform.processor() or platform.machine()  # processor() is "" on many Linux machines
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else cpu
    ratio = framework["samples_per_s"] / theirs["samples_per_s"] if theirs else None
    options = {k: getattr(args, k) for k in ("compile", "compile_mode", "quantize", "attention_backend")}
    print(
        f"job {args.arch} -> student={args.student}, b{args.batch}, {args.latent_height}x{args.latent_width} latents, "
        f"{args.precision}, placement {args.placement if args.device.startswith('cuda') else 'cpu'}, {options}, "
        f"{args.steps} steps ({args.warmup} warm-up), {device}"
    )
    print(f"{'loop':<14}{'samples/s':>11}{'step ms':>9}{'teacher ms':>12}{'student ms':>12}{'peak GiB':>10}  loss")
    for name, r in (("wandistiller", framework), ("hand-written", theirs or {})):
        if not r:
            continue
        print(
            f"{name:<14}{r['samples_per_s']:>11.2f}{r['step_ms_median']:>9.1f}{r['teacher_ms_median']:>12.1f}"
            f"{r['student_ms_median']:>12.1f}{r['peak_gib'] or 0:>10.2f}  {r['loss_last']:.6g}"
        )
    error = (theirs or {}).get("target_rel_mse_vs_bf16")
    if ratio is not None:
        print(
            f"ratio {ratio:.3f}x (target >= 1.00x)"
            + (f"; fp8 targets' relative MSE {error:.2e} (<= 1e-2)" if error else "")
        )
    return {
        "benchmark": "job",
        "arch": args.arch,
        "device": device,
        "date": time.strftime("%Y-%m-%d"),
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "framework": framework,
        "handwritten": theirs,
        "ratio": ratio,
    }


def _defaults(args) -> None:
    """Sizes that depend on the architecture: a real one trains `small` on a 480x832 frame."""
    real = args.arch != "tiny"
    args.student = args.student or ("small" if real else "tiny")
    args.latent_height = args.latent_height or (60 if real else 8)
    args.latent_width = args.latent_width or (104 if real else 8)
    args.precision = args.precision or ("bf16" if args.device.startswith("cuda") or args.quantize else "fp32")


def add_parser(sub) -> None:
    j = sub.add_parser("job", help="the train job at real shapes vs a hand-written loop, same arithmetic")
    j.add_argument("--arch", choices=sorted(ARCHS), default="1.3b")
    j.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    j.add_argument("--placement", choices=["gpu", "offload"], default="gpu")
    j.add_argument("--student", default=None, help="student config (default: small; tiny for --arch tiny)")
    j.add_argument("--precision", choices=sorted(handwritten.DTYPES), default=None)
    j.add_argument("--batch", type=int, default=16)
    j.add_argument("--steps", type=int, default=20)
    j.add_argument("--warmup", type=int, default=5, help="steps not timed (compilation, CUDA graph capture)")
    j.add_argument("--log-every", type=int, default=10, help="both loops read the loss at these steps")
    j.add_argument("--latent-height", type=int, default=None)
    j.add_argument("--latent-width", type=int, default=None)
    j.add_argument("--compile", action="store_true", help="regional torch.compile of teacher and student")
    j.add_argument("--compile-mode", default=None, help="student compile mode: reduce-overhead, max-autotune")
    j.add_argument("--quantize", choices=["fp8"], default=None, help="fp8 teacher (wandistiller.teacher.fp8)")
    j.add_argument("--attention-backend", default=None, help="the teacher's diffusers attention backend")
    j.add_argument("--seed", type=int, default=0)
    j.add_argument("--framework-only", action="store_true", help="skip the hand-written loop (no ratio)")
    j.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more train override, e.g. method=dmd (repeatable; not for the hand-written loop: --framework-only)",
    )
    j.add_argument("--cache-dir", default=CACHE)
    j.add_argument("--out", default=out_path("job"))
