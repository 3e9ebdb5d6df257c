#!/usr/bin/env bash
# Collect, here (PyPI reachable), the wheels the device image lacks into .whl/ (git-ignored), for
# scripts/gpu_figures.sh and scripts/gpu_plan_figures.sh. Run from the repository root:
#   bash scripts/gpu_wheels.sh
# The image (torch 2.11 cu130, Python 3.12) has transformers, accelerate, safetensors, huggingface-hub, pillow,
# tqdm, matplotlib, numpy, pyyaml, packaging, regex, requests, filelock, zipp. It lacks diffusers and its
# importlib_metadata (10.x needs lazy-importer), hydra-core and omegaconf (+ antlr4-python3-runtime, an sdist
# only: built into a wheel here). torchmetrics (+ lightning-utilities) and pytest (+ pluggy, iniconfig) are
# listed in one reading of the image and missing in another, so they travel too: a carried copy in
# /tmp/site wins over the image's, and all of it is ~12 MB. peft travels at the version pyproject pins (the image's
# may differ; student=lora saves through it). No torchao: wandistiller.teacher.fp8 is plain torch.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
WHL=.whl
mkdir -p "$WHL"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d "$WHL" diffusers==0.42.1 importlib_metadata==10.2.0 lazy-importer==0.1.0 hydra-core==1.3.8 omegaconf==2.3.1 \
  torchmetrics==1.9.0 lightning-utilities==0.15.3 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 peft==0.21.2
if ! ls "$WHL"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1; then
  SD=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary=:all: -d "$SD" antlr4-python3-runtime==4.9.3
  python3 -m pip wheel -q --no-deps -w "$WHL" "$SD"/antlr4-python3-runtime-4.9.3.tar.gz
  rm -rf "$SD"
fi
# A reference benchmark of your own to run beside ours on the same card (gpu_figures.sh step gpu_baseline):
# GPU_BASELINE=/path/to/gpu_baseline.py bash scripts/gpu_wheels.sh
[ -n "${GPU_BASELINE:-}" ] && cp "$GPU_BASELINE" "$WHL"/gpu_baseline.py || echo "(GPU_BASELINE not set: the baseline step is skipped)"
ls -1 "$WHL"
du -sh "$WHL"
