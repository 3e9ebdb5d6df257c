#!/usr/bin/env bash
# Every GPU figure docs/PERFORMANCE.md leaves to measure (fp8 that runs, the whole job's parity with a hand-written
# loop, the planner's host datum), in ONE device call of under 10 minutes (530 s of steps) on one H100/H200. Steps run in priority
# order against one deadline: a step that would not fit is skipped and says so, so the call always ends in
# time with what it measured.
#
# Before the call, here, in the repository root (PyPI reachable; collects ~12 MB of wheels into .whl/):
#   bash scripts/gpu_wheels.sh
# Then: run(command="bash scripts/gpu_figures.sh", carry=[".whl"], timeout_s=570)
# Everything comes back as $OUT/figures.tar (JSONs and per-step logs) plus $OUT/log.txt. Afterwards, here:
# record each figure in docs/PERFORMANCE.md with the card and date (the table's "left to measure" rows name
# the step that measures each), and fold plan_*.json into the planner (scripts/fit_planner.py).
set -uo pipefail
OUT=${OUT:-gpu_figures}
DEADLINE=${DEADLINE:-530}  # seconds from the start; the call's limit (570) leaves room for install and tar
source scripts/gpu_common.sh

JOB=(python3 -m wandistiller.bench job --arch 1.3b --device cuda --placement gpu --batch 16 --cache-dir /tmp/wandistiller)

# 1. fp8 works on this torch and GPU: the GPU lane (fp8 scaled_mm chosen, streamed == resident, compiled runs).
step gpu_tests 45 python3 -m pytest -x -q -p no:cacheprovider tests/test_gpu.py
# 1b. The LoRA student at the 1.3B shape, batch 1, one 480x832 frame: dmd with a LoRA fake
#     score, K=4, the teacher resident (gpu) and streamed with backward through it (offload): the planner's GPU and
#     host predictions beside the measured peaks, and samples/s. Also dmd under offload.
step lora_1.3b 110 python3 -m wandistiller.bench plan --arch 1.3b --device cuda --student lora --batch 1 \
  --placements gpu,offload --set method=dmd --set method.fake_score=lora --set method.steps=4 --folder /tmp/bench_plan \
  --cache-dir /tmp/wandistiller --out "$FIG/lora_1.3b.json"
# 2. fp8 + compile, the framework (builds the 1.3B-shaped teacher folder first, cached for the rest). Its
#    train.log says when compiling starts and how long it took (target: first step <= 60 s after loading).
step job_fp8 75 "${JOB[@]}" --compile --quantize fp8 --steps 12 --warmup 5 --framework-only --out "$FIG/job_fp8.json"
python3 -c "import json,shutil,sys; r=json.load(open(sys.argv[1]))['framework']['run_dir']; \
shutil.copy(r + '/train.log', sys.argv[2])" "$FIG/job_fp8.json" "$FIG/job_fp8_train.log" 2>/dev/null \
  && grep -E "compil|step 1\b|teacher" "$FIG/job_fp8_train.log" | head -20
# 3. bf16 compiled, the framework: the denominator of the fp8 target (>= 1.3x).
step job_compiled 70 "${JOB[@]}" --compile --steps 12 --warmup 5 --framework-only --out "$FIG/job_compiled.json"
# 4. A 14B expert in fp8 streamed from pinned RAM, against resident fp8 and resident bf16 (each its own process):
#    b1 <= 0.6x the bf16 copy floor, b8 <= 1.05x resident fp8, peak <= 2 GiB, bit-identical, relative MSE <= 1%.
step teacher_fp8 120 python3 -m wandistiller.bench teacher --arch 14b --batch 1,8 --reps 3 --quantize fp8 \
  --resident-blocks 0 --out "$FIG/teacher_fp8.json"
# 5. The whole job eager against the hand-written eager loop: parity, and the 2x goal's denominator (an
#    H200 measured 26.6 samples/s: >= 53 is the goal); the fp8 job's relative MSE if time is left.
step job_eager 200 "${JOB[@]}" --steps 12 --warmup 4 --out "$FIG/job_eager.json"  # did not end in 112 s on an H100
# 6. The planner's host column at the real shape: predicted vs measured host and GPU peaks.
step plan_1.3b 90 bash scripts/gpu_plan_figures.sh 1.3b "$FIG"
# 7. fp8 targets against bf16 through the hand-written loop, and the shared reference figures, if time is left.
step job_fp8_handwritten 90 "${JOB[@]}" --compile --quantize fp8 --steps 8 --warmup 4 --out "$FIG/job_fp8_both.json"
if [ -f .whl/gpu_baseline.py ]; then step gpu_baseline 100 python3 .whl/gpu_baseline.py "$FIG"; fi
echo "total ${SECONDS}s"
