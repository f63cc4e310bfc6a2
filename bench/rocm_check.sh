#!/usr/bin/env bash
# One command for the day an AMD Instinct GPU (MI300X, MI355X) is at hand: what the offline checks
# (tests/test_rocm.py, tests/test_rocm_compile.py) cannot show, measured on the GPU.
# Needs a ROCm 7 runtime on the machine and `pip install -e ".[rocm,test]"`.
# Usage (repo root): bash bench/rocm_check.sh [pytest args...]; logs go to $OUT (default /tmp/out).
#   1. the compiled contract tests (pytest -m gpu: sampler == learner bits, batch and chunk invariance)
#   2. the tile-agreement tests compiled on the ROCm table (a row's bits across the matmul tile
#      classes and attention programs: the MFMA rule made the table; this shows the bits)
#   3. the mismatch benchmark: logprobs compared and bits differing, strict and fast
set -uo pipefail
OUT=${OUT:-/tmp/out}; PY=${PY:-python3}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
"$PY" -c "import jax, sys; d = jax.devices()[0]; print(d.platform, d.device_kind, d.client.platform_version)
sys.exit(0 if 'rocm' in d.client.platform_version.lower() else 'no ROCm GPU visible to JAX')" || exit 1
"$PY" -m bench._report --command "bash bench/rocm_check.sh $*" --out "$OUT/env.json"
"$PY" -m pytest -m gpu -q "$@" 2>&1 | tee "$OUT/pytest_gpu.log"
status=${PIPESTATUS[0]}
"$PY" -m pytest -q tests/test_kernels.py -k "tile_configs_agree or tiles_per_program_agree or fused_projections" \
    tests/test_hlo_audit.py 2>&1 | tee "$OUT/pytest_tiles.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$PY" -m bench.mismatch --models qwen3-0.6b --batch 64 --new-tokens 256 --out "$OUT/mismatch.json"
[ $? -eq 0 ] || status=1
exit "$status"
