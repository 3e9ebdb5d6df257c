# Sourced by the device scripts (gpu_figures.sh, gpu_lora_figures.sh), with OUT and DEADLINE set: installs the carried
# wheels, names the card, tees the output to $OUT/log.txt, tars $FIG (each step's log and JSON) into
# $OUT/figures.tar at exit, and defines `step`.
FIG=$(mktemp -d)
mkdir -p "$OUT"
trap 'tar -cf "$OUT/figures.tar" -C "$FIG" . 2>/dev/null' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 WANDB_MODE=disabled WANDB_ERROR_REPORTING=false HF_HUB_OFFLINE=1
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$FIG/card.txt"
python3 -c "import torch, diffusers, hydra; print('torch', torch.__version__, 'diffusers', diffusers.__version__)"

# step NAME NEEDS_S CMD...: run CMD if NEEDS_S seconds are left before the deadline, cut at the deadline; with
# ONLY="name ..." set, only the steps it names.
step() {
  local name=$1 needs=$2 left=$((DEADLINE - SECONDS)); shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then echo "[$name] not in ONLY"; return; fi
  if ((left < needs)); then echo "[$name] SKIPPED: ${left}s left, needs ~${needs}s"; return; fi
  echo "[$name] start at ${SECONDS}s"
  timeout "$left" "$@" 2>&1 | tee "$FIG/$name.log"
  echo "[$name] done at ${SECONDS}s (exit ${PIPESTATUS[0]})"
}
