"""Benchmarks you run on purpose (never timed unit tests): `python -m wandistiller.bench SUBCOMMAND`.

    python -m wandistiller.bench overhead [--steps 40] [--reps 5] [--out outputs/bench/overhead.json]
    python -m wandistiller.bench teacher --arch 14b --placement offload --batch 1,8 [--resident-blocks 0] [--compile]
    python -m wandistiller.bench load --arch 1.3b [--folder $WANDISTILLER_CACHE/bench_1.3b]
    python -m wandistiller.bench job --arch 1.3b --device cuda [--compile] [--placement gpu|offload] [--batch 16]
    python -m wandistiller.bench grad-check [teacher=... teacher.quantize=fp8] [--steps 3] [--resident-blocks 1]

Each subcommand's module says what it measures and against what: overhead.py, teacher.py, load.py, job.py, gradcheck.py.
Every one prints a short table last and writes its numbers to --out (JSON; default outputs/bench/<name>.json,
beside the runs, never the repository root). Built teachers go under WANDISTILLER_CACHE, as for training.
"""

import os

from wandistiller.core.errors import UserError
from wandistiller.job.checks import MAX_LATENT

CACHE = os.environ.get("WANDISTILLER_CACHE", "~/.cache/wandistiller")  # the train job's paths.cache_dir default


def out_path(name: str) -> str:
    return f"outputs/bench/{name}.json"


def check_latent(flag: str, value: int | None) -> None:
    """A latent height or width as train's `data.latent_*` takes it: even (Wan patches 2x2), at most MAX_LATENT."""
    if value is not None and (value % 2 or not 0 < value <= MAX_LATENT):
        raise UserError(f"{flag}={value} must be an even number from 2 to {MAX_LATENT} (Wan patches 2x2)")
