#!/usr/bin/env bash
# One command: the compiled test suite and the mismatch benchmark on the GPU (NVIDIA or AMD).
# Usage (repo root, on the GPU machine): bash bench/gpu_check.sh [pytest args...]; logs go to $OUT.
# Writes $OUT/env.json (provenance), pytest_gpu.log and mismatch.json (logprobs compared, bits differing).
set -uo pipefail
OUT=${OUT:-/tmp/out}; PY=${PY:-python3}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
"$PY" -m bench._report --command "bash bench/gpu_check.sh $*" --out "$OUT/env.json"
"$PY" -m pytest -m gpu -q "$@" 2>&1 | tee "$OUT/pytest_gpu.log"
status=${PIPESTATUS[0]}
"$PY" -m bench.mismatch --models qwen3-0.6b --batch 64 --new-tokens 256 --out "$OUT/mismatch.json"
exit "$status"
