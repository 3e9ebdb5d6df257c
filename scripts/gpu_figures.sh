#!/usr/bin/env bash
# Every GPU figure docs/PERFORMANCE.md lacks, in one device call on one H100/H200: the shared reference
# run and ours on the same card, eager and compiled, all-streamed and half-resident. Sized for one
# 10-minute call; not yet run anywhere (no session of this project has been lent a GPU so far).
#
# Before the call, here (the device image has torch/accelerate/transformers, not diffusers):
#   echo /.whl/ >> .git/info/exclude; mkdir -p .whl && cp ../shared/gpu_baseline.py .whl/
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl diffusers==0.42.1 importlib_metadata==10.2.0 omegaconf==2.3.1
#   python3 -m pip download --no-deps -d /tmp/sd antlr4-python3-runtime==4.9.3 && \
#     python3 -m pip wheel --no-deps -w .whl /tmp/sd/antlr4-python3-runtime-4.9.3.tar.gz   # sdist only
# Then: run(command="bash scripts/gpu_figures.sh", carry=[".whl"], timeout_s=600)
set -euo pipefail
OUT=${OUT:-gpu_figures}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/card.txt"
bench() { python3 -m wandistiller.bench teacher --arch 14b "$@"; }
bench --batch 1,8 --resident-blocks 0 --out "$OUT/offload_eager.json" 2>&1 | tee "$OUT/log.txt"
bench --batch 1,4,8 --resident-blocks 0 --compile --out "$OUT/offload_compiled.json" 2>&1 | tee -a "$OUT/log.txt"
bench --batch 1 --resident-blocks 20 --out "$OUT/offload_half_resident.json" 2>&1 | tee -a "$OUT/log.txt"
python3 .whl/gpu_baseline.py "$OUT" 2>&1 | tee -a "$OUT/log.txt"
