#!/usr/bin/env bash
# Every GPU figure issue 12 asks for, in one device call of under 8 minutes on one H100/H200: the whole job
# against a hand-written loop (eager, compiled, fast paths), the streamed teacher's compiled peak, and the
# shared reference run on the same card. Steps run in priority order against one deadline: a step that
# would not fit is skipped and says so, so the call always ends in time with what it measured.
#
# Before the call, here, in the repository root (the device image has torch 2.11, transformers,
# accelerate, pillow, tqdm, safetensors, huggingface-hub, zipp -- not these):
#   echo /.whl/ >> .git/info/exclude; mkdir -p .whl && cp ../shared/gpu_baseline.py .whl/
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     diffusers==0.42.1 importlib_metadata==10.2.0 lazy-importer==0.1.0 hydra-core==1.3.8 omegaconf==2.3.1 \
#     torchao==0.18.0
#   python3 -m pip download --no-deps --no-binary=:all: -d /tmp/sd antlr4-python3-runtime==4.9.3 && \
#     python3 -m pip wheel --no-deps -w .whl /tmp/sd/antlr4-python3-runtime-4.9.3.tar.gz   # an sdist only
# (~10 MB; importlib_metadata 10 needs lazy-importer on Python < 3.15; torchao 0.18 is built for torch 2.11.)
# Then: run(command="bash scripts/gpu_figures.sh", carry=[".whl"], timeout_s=540)
# Everything comes back as $OUT/figures.tar (JSONs and per-step logs) plus $OUT/log.txt.
set -uo pipefail
OUT=${OUT:-gpu_figures}
FIG=$(mktemp -d)
DEADLINE=${DEADLINE:-465}  # seconds from the start; the call's own limit (540) leaves room for start-up
mkdir -p "$OUT"
trap 'tar -cf "$OUT/figures.tar" -C "$FIG" . 2>/dev/null' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$FIG/card.txt"

# step NAME NEEDS_S CMD...: run CMD if NEEDS_S seconds are left before the deadline, cut at the deadline.
step() {
  local name=$1 needs=$2 left=$((DEADLINE - SECONDS)); shift 2
  if ((left < needs)); then echo "[$name] SKIPPED: ${left}s left, needs ~${needs}s"; return; fi
  echo "[$name] start at ${SECONDS}s"
  timeout "$left" "$@" || echo "[$name] FAILED or cut (exit $?)"
  echo "[$name] done at ${SECONDS}s"
}
JOB=(python3 -m wandistiller.bench job --arch 1.3b --device cuda --placement gpu --batch 16)

# 1-2. The whole job against the hand-written loop (1.3B-shaped teacher, student=small, b16, 1560 tokens).
#      The first builds the teacher folder (cached for the rest).
step job_eager 150 "${JOB[@]}" --steps 14 --warmup 4 --out "$FIG/job_eager.json"
step job_compiled 150 "${JOB[@]}" --compile --steps 16 --warmup 6 --out "$FIG/job_compiled.json"
# 3. The streamed 14B teacher, compiled, each model in its own process: peak <= 3.5 GiB expected.
step teacher_compiled 110 python3 -m wandistiller.bench teacher --arch 14b --batch 1,8 --reps 3 --compile \
  --resident-blocks 0 --out "$FIG/teacher_compiled.json"
# 4. Fast paths on the framework (the 2x goal is against job_eager's hand-written samples/s).
step job_fp8 100 "${JOB[@]}" --compile --quantize fp8 --steps 16 --warmup 6 --out "$FIG/job_fp8.json"
step job_fp8_graphs 100 "${JOB[@]}" --compile --quantize fp8 --compile-mode reduce-overhead --steps 16 --warmup 6 \
  --framework-only --out "$FIG/job_fp8_graphs.json"
# 5. The shared reference figures on the same card.
step gpu_baseline 100 python3 .whl/gpu_baseline.py "$FIG"
# 6. What is left: the attention backend alone, and the planner bench if this checkout has one.
step job_cudnn 80 "${JOB[@]}" --attention-backend _native_cudnn --steps 12 --warmup 4 --framework-only \
  --out "$FIG/job_cudnn.json"
if python3 -m wandistiller.bench --help 2>/dev/null | grep -q "plan"; then
  step bench_plan 120 python3 -m wandistiller.bench plan --arch 1.3b --device cuda --student small --batch 16 \
    --placements gpu,offload,disk --folder /tmp/bench_plan --out "$FIG/bench_plan.json"
fi
echo "total ${SECONDS}s"
