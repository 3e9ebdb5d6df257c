#!/usr/bin/env bash
# The planner's predictions against measured peaks on a GPU (docs/PLANNER.md): `bench plan` per
# placement, each in a fresh process. The host column is extrapolated until this has run (docs/PLANNER.md).
#
#   bash scripts/gpu_plan_figures.sh 1.3b [OUT_DIR]   # step 6 of scripts/gpu_figures.sh (its wheels, its call)
#   bash scripts/gpu_plan_figures.sh 14b [OUT_DIR]    # alone: run(command=..., carry=[".whl"], timeout_s=600);
#                                                     # the 14B folder alone is 28.6 GB written once
# Afterwards, here: python scripts/fit_planner.py docs/planner_data/*.json (copy the JSONs in first).
set -uo pipefail
ARCH=${1:-1.3b}
OUT=${2:-${OUT:-gpu_plan_figures}}
mkdir -p "$OUT"
if [ -z "${PYTHONPATH:-}" ]; then  # alone, not inside gpu_figures.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 WANDB_MODE=offline WANDB_ERROR_REPORTING=false HF_HUB_OFFLINE=1
fi
plan() { python3 -m wandistiller.bench plan --arch "$ARCH" --device cuda --student small --folder /tmp/bench_plan \
  --cache-dir /tmp/wandistiller "$@" 2>&1 | tee -a "$OUT/log_plan_$ARCH.txt"; }
if [ "$ARCH" = 1.3b ]; then
  # The recorded datum's shape (b16, one 480x832 frame): resident eager, then compiled, then streamed.
  plan --batch 16 --placements gpu --out "$OUT/plan_1.3b_eager.json"
  plan --batch 16 --placements gpu --compile --out "$OUT/plan_1.3b_compiled.json"
  plan --batch 16 --placements offload,disk --out "$OUT/plan_1.3b_streamed.json"
else
  plan --batch 4 --placements gpu,offload,disk --out "$OUT/plan_14b_eager.json"
fi
