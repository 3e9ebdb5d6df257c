#!/usr/bin/env bash
# The planner's GPU predictions against measured peaks (issue 13), for the lead to fold into
# scripts/gpu_figures.sh: `bench plan` for gpu, offload and disk at the 1.3B and 14B shapes, each placement
# in a fresh process. Not yet run anywhere (no GPU in the session that wrote it).
#
# Same wheels as gpu_figures.sh, plus hydra-core (the training job composes its config with Hydra):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl hydra-core==1.3.8
# Then, one shape per device call (each fits 10 minutes; the 14B folder alone is 28.6 GB written once):
#   run(command="bash scripts/gpu_plan_figures.sh 1.3b", carry=[".whl"], timeout_s=600)
#   run(command="bash scripts/gpu_plan_figures.sh 14b", carry=[".whl"], timeout_s=600)
# Afterwards, here: python scripts/fit_planner.py docs/planner_data/*.json (copy the JSONs in first).
set -euo pipefail
ARCH=${1:-1.3b}
OUT=${OUT:-gpu_plan_figures}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 WANDB_MODE=offline WANDB_ERROR_REPORTING=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/card.txt"
plan() { python3 -m wandistiller.bench plan --arch "$ARCH" --device cuda --student small --folder /tmp/bench_plan \
  --cache-dir /tmp/wandistiller "$@" 2>&1 | tee -a "$OUT/log_$ARCH.txt"; }
if [ "$ARCH" = 1.3b ]; then
  # The recorded datum's shape (b16, one 480x832 frame), eager then compiled, then the streamed placements.
  plan --batch 16 --placements gpu,offload,disk --out "$OUT/plan_1.3b_eager.json"
  plan --batch 16 --placements gpu --compile --out "$OUT/plan_1.3b_compiled.json"
else
  plan --batch 4 --placements gpu,offload,disk --out "$OUT/plan_14b_eager.json"
fi
