#!/usr/bin/env bash
# temporary: session 6 call D (short: ~200 s)
set -uo pipefail
OUT=${OUT:-/tmp/out}; W=/tmp/w; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache
{ date -u +%FT%TZ; git rev-parse HEAD; git status --short | head -20; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import jax, jaxlib, numpy; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "numpy", numpy.__version__, jax.devices())'; } > $W/env.txt 2>&1
(
  export CUDA_VISIBLE_DEVICES=0
  timeout -k 5 110 python3 -m bench.server_e2e --model qwen3-0.6b --requests 256 --max-prompt 512 --min-new-tokens 128 --max-new-tokens 512 --max-batch 256 --decode-steps 8 --kernel-ref --out $W/server_e2e.json > $W/server_e2e.log 2>&1; echo "server_e2e rc=$? t=$SECONDS" >> $W/times.txt
  timeout -k 5 $((185-SECONDS)) python3 -m bench.server_latency --model qwen3-0.6b --concurrency 1,16,256 --prompt 128 --max-tokens 128 --decode-steps 8 --max-batch 256 --num-pages 16384 --max-context 1024 --out $W/latency.json > $W/latency.log 2>&1; echo "latency rc=$? t=$SECONDS" >> $W/times.txt
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout -k 5 110 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 -m bench.rollout --models qwen3-0.6b --batches 16,64,256 --context 512 --new-tokens 64 --repeats 2 --sync-models "" --out $W/rollout.json > $W/rollout.log 2>&1; echo "rollout rc=$? t=$SECONDS" >> $W/times.txt
  timeout -k 5 $((185-SECONDS)) python3 -m pytest tests/test_engine.py -q -x -k "continue or single_steps or stop_tokens" > $W/pytest_engine.log 2>&1; echo "pytest_engine rc=$? t=$SECONDS" >> $W/times.txt
) &
wait
cat $W/times.txt; tail -n 3 $W/pytest_engine.log
mkdir -p $W/sum && cp $W/server_e2e.json $W/latency.json $W/rollout.json $W/sum/ 2>/dev/null; python3 -m bench.e2e_summary $W/sum
tar czf $OUT/d.tgz -C $W .
