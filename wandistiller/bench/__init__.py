"""Benchmarks you run on purpose (never timed unit tests): `python -m wandistiller.bench SUBCOMMAND`.

    python -m wandistiller.bench overhead [--steps 40] [--reps 5] [--out bench_overhead.json]
    python -m wandistiller.bench teacher --arch 14b --placement offload --batch 1,8 [--resident-blocks 0] [--compile]
    python -m wandistiller.bench load --arch 1.3b [--folder ~/.cache/wandistiller/bench_1.3b]
    python -m wandistiller.bench job --arch 1.3b --device cuda [--compile] [--placement gpu|offload] [--batch 16]

Each subcommand's module says what it measures and against what: overhead.py, teacher.py, load.py, job.py.
Every one prints a short table last and writes its numbers to --out (JSON).
"""
