"""`python -m wandistiller.bench SUBCOMMAND`: parse, run the chosen benchmark, write its JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import wandistiller.bench as package
from wandistiller.bench import (
    CACHE,
    check_latent,
    gradcheck,
    job,
    load,
    lora_overhead,
    out_path,
    overhead,
    plan,
    teacher,
)
from wandistiller.bench.models import ARCHS
from wandistiller.core.errors import OneLineParser, UserError, exit_on_user_error
from wandistiller.core.files import enclosing_run, folder_problem, read_in, run_holding
from wandistiller.student.lora import BUILDER
from wandistiller.teacher.model import compile_unavailable


def parser() -> argparse.ArgumentParser:
    main_parser = OneLineParser(
        prog="python -m wandistiller.bench",
        description=package.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = main_parser.add_subparsers(dest="bench", required=True)
    p = sub.add_parser("overhead", help="framework loop vs a hand-written loop on the tiny CPU default")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--cache-dir", default=CACHE)
    p.add_argument(
        "--student",
        choices=[BUILDER],
        default=None,
        help="lora: the LoRA student's step (student=lora method=kd) vs a hand-written LoRA step (use --batch-size 1)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="with --student lora: both sides' blocks regionally compiled (teacher.compile=true's compile_blocks)",
    )
    p.add_argument("--out", default=out_path("overhead"))
    t = sub.add_parser("teacher", help="a streamed teacher forward vs the GPU-resident one (random weights)")
    t.add_argument("--arch", choices=sorted(ARCHS), default="14b")
    t.add_argument("--placement", choices=["offload"], default="offload")
    t.add_argument("--batch", default="1,8")
    t.add_argument("--resident-blocks", default="0", help="blocks kept on the device: a count, or auto")
    t.add_argument("--latent-height", type=int, default=60)
    t.add_argument("--latent-width", type=int, default=104)
    t.add_argument("--reps", type=int, default=5)
    t.add_argument("--compile", action="store_true", help="regional torch.compile for both (compile_blocks)")
    t.add_argument(
        "--quantize", choices=["fp8"], default=None, help="fp8 blocks (wandistiller.teacher.fp8), vs bf16 too"
    )
    t.add_argument(
        "--fp8-compute",
        choices=["auto", "scaled_mm", "dequant"],
        default="auto",
        help="fp8 matmuls: _scaled_mm, or the weights widened to bf16 per layer",
    )
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--out", default=out_path("teacher"))
    ld = sub.add_parser("load", help="host memory and time to load one expert, each loader in a fresh process")
    ld.add_argument("--arch", choices=sorted(ARCHS), default="1.3b")
    ld.add_argument("--folder", default=f"{CACHE}/bench_1.3b")
    ld.add_argument("--device", default="cpu")
    ld.add_argument("--out", default=out_path("load"))
    job.add_parser(sub)
    plan.add_arguments(sub.add_parser("plan", help="the planner's predictions beside measured peaks (fresh processes)"))
    gradcheck.add_arguments(
        sub.add_parser("grad-check", help="LoRA gradients through the streamed teacher vs the resident one, here")
    )
    return main_parser


def main() -> None:
    args = parser().parse_args()
    if args.bench == "overhead":
        bench = lora_overhead.lora_overhead if args.student else overhead.overhead
    elif args.bench == "teacher":
        bench = teacher.teacher_bench
    elif args.bench == "load":
        bench = load.load_bench
    elif args.bench == "plan":
        bench = plan.run
    elif args.bench == "grad-check":
        bench = gradcheck.run
    else:
        bench = job.job_bench
    with exit_on_user_error():  # a bad flag value is one line, as for the train job
        check_args(args)
        result = bench(args)
        try:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))
        except OSError as e:
            raise UserError(f"--out {args.out} cannot be written ({e.strerror}); choose another file") from None
    print(f"wrote {args.out}")
    if result.get("ok") is False:  # grad-check's FAIL: a script or CI sees it
        raise SystemExit(1)


# Counts every subcommand may take: each must be 1 or more (--warmup: 0 or more).
COUNTS = ("steps", "reps", "batch_size", "batch", "latent_height", "latent_width", "log_every")


def check_args(args: argparse.Namespace) -> None:
    """What every benchmark needs of its flags, checked before minutes of setup: one line each."""

    for name in COUNTS:
        value = getattr(args, name, None)
        values = [] if value is None else value.split(",") if isinstance(value, str) and name == "batch" else [value]
        for v in values:
            if not str(v).strip().isdigit() or int(v) <= 0:
                what = "sizes, each 1 or more (e.g. 1,8)" if name == "batch" else "1 or more"
                raise UserError(f"--{name.replace('_', '-')}={value} must be {what}")
    if args.bench == "grad-check":
        gradcheck.check(args)
    if args.bench == "plan":
        plan.check(args)
    if args.bench == "overhead" and args.compile:
        if not args.student:
            raise UserError("overhead --compile compares compiled LoRA steps; add --student lora")
        why = compile_unavailable(torch.device("cpu"))
        if why:
            raise UserError(f"overhead --compile compiles on the CPU, and {why}; drop --compile")
    if getattr(args, "warmup", 0) < 0:
        raise UserError(f"--warmup={args.warmup} must be 0 or more")
    device = getattr(args, "device", "cpu")
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise UserError(f"--device={device!r} is not a device; use cpu or cuda") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"--device={device}: this machine has no CUDA GPU that torch {torch.__version__} can use; use --device cpu"
        )
    if args.bench in ("teacher", "job") and kind == "cpu" and args.arch != "tiny":
        raise UserError(f"--arch {args.arch} on the CPU would take hours; run it on a GPU, or use --arch tiny here")
    for flag in ("latent_height", "latent_width"):  # what train's data.latent_* take: a huge one was a traceback
        check_latent(f"--{flag.replace('_', '-')}", getattr(args, flag, None))
    check_out(args.out)
    cache = getattr(args, "cache_dir", None)
    run = cache and run_holding(Path(cache))
    if run:  # its embeddings/ and teachers/ were written into a finished run, which train's paths.cache_dir refuses
        raise UserError(f"--cache-dir {cache} is or lies in the run folder {run}; choose a cache folder outside runs")


RESULT_BYTES = 16 << 20


def check_out(given: str) -> None:
    """`--out`: a file that can be written, outside any run folder, new or a result a benchmark wrote (JSON); a
    finished run's metrics.json was replaced by a grad-check's result."""
    out = Path(given).expanduser()
    problem = "it is a folder" if out.is_dir() else folder_problem(out.parent if str(out.parent) else Path("."))
    if problem:
        raise UserError(f"--out {given}: {problem}; choose another file")
    run = enclosing_run(out)
    if run is not None:
        raise UserError(
            f"--out {given} lies in the run folder {run}, whose files are the run's; choose a file elsewhere"
        )
    if out.is_file():
        try:  # a result is kilobytes: a larger file is not one
            json.loads(read_in(out.parent, out.name, limit=RESULT_BYTES, what="benchmark result") or b"null")
        except (ValueError, UserError):
            raise UserError(
                f"--out {given} holds something other than a benchmark's JSON, which the result would replace; "
                "choose a new file"
            ) from None


if __name__ == "__main__":
    main()
