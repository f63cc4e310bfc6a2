#!/usr/bin/env bash
# One device call: the compiled test suite and the mismatch benchmark on the GPU.
# Usage (repo root, on the GPU machine): bash bench/gpu_check.sh [pytest args...]; logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import jax, jaxlib, numpy; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'numpy', numpy.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.txt"
