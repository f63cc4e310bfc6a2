#!/usr/bin/env bash
# The end-to-end measurements on one H200 within 600 s of wall time (this script stops by TOTAL):
#
#   bash bench/e2e.sh            # on the GPU machine, repo root or anywhere
#   DRY=1 bash bench/e2e.sh      # every piece at qwen3-tiny, tiny sizes, on the CPU (checks the script)
#
# Pieces, most valuable first, each under `timeout` with its own budget (s, estimated for an H200 below), cut to
# what is left of TOTAL (default 560 s); a piece with less than MIN_PIECE (45 s) left is skipped, not started:
#   grpo_<model>_strict 160, grpo_<model>_fast 190
#            bench.grpo_compare, P32 x G8 x 512 new tokens, verify on, 2 steps (the first compiles; the second is
#            the number): step split rollout / learn / sync / host. Estimate at 0.6B: ~90 s of compilation,
#            then ~25 s a step strict (131k tokens at ~18k tok/s decode, ~12 s learn + verify pass), ~35 s
#            fast (decode ~7k tok/s at batch 256). Micro-batch 8 for both: XLA's compiled memory analysis of
#            the fast learner step at 640 tokens (`python -m bench.learner_memory --model qwen3-0.6b
#            --devices=1 --numerics fast --tokens 640`) gives ~75 GiB at 8 sequences, ~280 GiB at 32.
#            qwen3-4b needs ~2-3x the time per run, so it is not in the default MODELS:
#            `MODELS=qwen3-4b PIECES=grpo bash bench/e2e.sh` is a call of its own (one H200: strict
#            20.7 s a step at micro-batch 8 without REMAT, 96.8 GiB peak, with the one-device learner on whole
#            weights, the KV cache freed while it learns and 640-token rows; `bench.grpo_compare` lets JAX take
#            95% of the GPU as train.grpo does). The fast side runs out of memory at 4B at micro-batch 8, with
#            REMAT too (its plain-XLA attention keeps [layers, B, H, T, T] fp32 probabilities); at
#            MICRO_BATCH=2 it fits (57.2 s a step, 87.8 GiB).
#   server_e2e 200
#            bench.server_e2e at qwen3-0.6b: 256 concurrent requests (prompts 1-512 tokens, n 1 or 4, 128-512 new
#            tokens; ~640 completions, ~200k tokens), every completion's logprob bits checked, output tokens/s vs
#            the kernel-level loop (--kernel-ref), POST /update_weights timed and the next completion checked.
#            Estimate: ~10 s start, ~80 s warm-up burst (compiles), ~20 s timed burst, ~15 s weight swap, ~50 s
#            scoring (a few shape buckets compile), ~25 s kernel-level loop.
#   latency 90
#            bench.server_latency at qwen3-0.6b, streaming, concurrency 1,16,256: TTFT and ITL p50/p99. Its
#            server's engine is server_e2e's, so its step functions come from the compilation cache.
#   rollout 200
#            bench.rollout: in-process weight sync at SYNC_MODELS (first: cheap), then ROLLOUT_MODELS (0.6B;
#            qwen3-8b if the budget allows) batches 16,64,256: engine vs kernel-level loop, strict and fast.
#            On one H200: 0.6B batches 16 and 64 took 120 s (the budget then), batch 256 another ~60 s.
# The budgets add up to 840 s, more than TOTAL: in one run, grpo and server_e2e are expected to finish and the
# last pieces get what is left (what the first ones leave unused). Rows are printed as they finish, so a cut
# piece keeps its finished rows in its .log (and its JSON: each bench rewrites it as it goes). What does not fit
# runs as a second run:
# `PIECES="latency rollout" bash bench/e2e.sh` (~290 s).
#
# Writes to $OUT (default /tmp/out): env.json, <piece>.log, <piece>.json, summary.txt (each piece's exit status,
# seconds and budget; 124 = cut by its timeout) and the summary printed at the end.
# Environment: DRY, TOTAL, MIN_PIECE, PY (default python3), PIECES (default "grpo server_e2e latency rollout"),
# MODELS (GRPO presets, default qwen3-0.6b), MICRO_BATCH_TOKENS (default auto), REMAT (auto, on or off: --remat), ROLLOUT_MODELS (default qwen3-0.6b),
# SYNC_MODELS (default qwen3-0.6b,qwen3-4b,qwen3-8b), B_STRICT B_FAST B_SERVER B_LATENCY B_ROLLOUT (the pieces' budgets), JAX_COMPILATION_CACHE_DIR (default /tmp/jax_cache: shared
# by the pieces' processes, so a shape compiled by one is loaded by the next).
set -uo pipefail
OUT=${OUT:-/tmp/out}; PY=${PY:-python3}; DRY=${DRY:-0}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
PIECES=${PIECES:-grpo server_e2e latency rollout}
MICRO_BATCH_TOKENS=${MICRO_BATCH_TOKENS:-auto}

if [ "$DRY" = 1 ]; then  # the same commands at tiny sizes on the CPU; budgets only guard against a hang
  export JAX_PLATFORMS=cpu
  TOTAL=${TOTAL:-3600}; MIN_PIECE=${MIN_PIECE:-10}
  MODELS=${MODELS:-qwen3-tiny}; ROLLOUT_MODELS=${ROLLOUT_MODELS:-qwen3-tiny}; SYNC_MODELS=${SYNC_MODELS:-qwen3-tiny}
  SERVED=qwen3-tiny
  GRPO_SHAPE=(--prompts 2 --group 2 --new-tokens 4 --micro-batch-tokens 64)
  SERVER_SHAPE=(--requests 6 --max-prompt 24 --min-new-tokens 2 --max-new-tokens 8 --max-batch 8 --decode-steps 2)
  LATENCY_SHAPE=(--concurrency 1,4 --prompt 8 --max-tokens 8 --decode-steps 2 --max-batch 8 --num-pages 16384
                 --max-context 32)
  ROLLOUT_SHAPE=(--batches 2,4 --context 16 --new-tokens 17 --repeats 1)
  B_STRICT=600; B_FAST=600; B_SERVER=600; B_LATENCY=600; B_ROLLOUT=600
else
  TOTAL=${TOTAL:-560}; MIN_PIECE=${MIN_PIECE:-45}
  MODELS=${MODELS:-qwen3-0.6b}; ROLLOUT_MODELS=${ROLLOUT_MODELS:-qwen3-0.6b}
  SYNC_MODELS=${SYNC_MODELS:-qwen3-0.6b,qwen3-4b,qwen3-8b}
  SERVED=qwen3-0.6b
  GRPO_SHAPE=(--prompts 32 --group 8 --new-tokens 512 --micro-batch-tokens "$MICRO_BATCH_TOKENS" --remat "${REMAT:-auto}")
  SERVER_SHAPE=(--requests 256 --max-prompt 512 --min-new-tokens 128 --max-new-tokens 512 --max-batch 256
                --decode-steps 8)
  # The server's engine as server_e2e's (pages, context, batch, decode steps), so its compiled step functions
  # come from the compilation cache.
  LATENCY_SHAPE=(--concurrency 1,16,256 --prompt 128 --max-tokens 128 --decode-steps 8 --max-batch 256
                 --num-pages 16384 --max-context 1024)
  ROLLOUT_SHAPE=(--batches 16,64,256 --context 512 --new-tokens 65 --repeats 2)
  B_STRICT=${B_STRICT:-160}; B_FAST=${B_FAST:-190}; B_SERVER=${B_SERVER:-200}; B_LATENCY=${B_LATENCY:-90}
  B_ROLLOUT=${B_ROLLOUT:-200}
fi

# Provenance (command, date, commit, hardware through JAX, versions) in env.json, as every piece's JSON carries it.
"$PY" -m bench._report --out "$OUT/env.json" --command "DRY=$DRY TOTAL=$TOTAL PIECES='$PIECES' MODELS=$MODELS \
ROLLOUT_MODELS=$ROLLOUT_MODELS SYNC_MODELS=$SYNC_MODELS MICRO_BATCH_TOKENS=$MICRO_BATCH_TOKENS REMAT=${REMAT:-auto} bash bench/e2e.sh"
: > "$OUT/summary.txt"

# piece NAME BUDGET command...: runs the command under `timeout` for min(BUDGET, what is left of TOTAL), its
# output in $OUT/NAME.log; records the exit status and seconds in summary.txt.
piece() {
  local name=$1 budget=$2; shift 2
  local left=$((TOTAL - SECONDS)); local limit=$((budget < left ? budget : left))
  if [ "$limit" -lt "$MIN_PIECE" ]; then
    echo "$name: skipped ($left s left of $TOTAL)" | tee -a "$OUT/summary.txt"; return
  fi
  echo "== $name (limit $limit s, budget $budget s, t=$SECONDS s)"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc, $((SECONDS - start)) s (limit $limit s, budget $budget s)" | tee -a "$OUT/summary.txt"
  tail -n 3 "$OUT/$name.log"
}

for p in $PIECES; do
  case "$p" in
    grpo)
      for m in ${MODELS//,/ }; do
        # The learner needs most of the GPU (JAX takes 75% by default).
        piece "grpo_${m}_strict" "$B_STRICT" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 "$PY" -m bench.grpo_compare \
          --models "$m" --numerics strict --steps 2 "${GRPO_SHAPE[@]}" --out "$OUT/grpo_${m}_strict.json"
        piece "grpo_${m}_fast" "$B_FAST" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 "$PY" -m bench.grpo_compare \
          --models "$m" --numerics fast --steps 2 "${GRPO_SHAPE[@]}" --out "$OUT/grpo_${m}_fast.json"
      done ;;
    server_e2e)
      piece server_e2e "$B_SERVER" "$PY" -m bench.server_e2e --model "$SERVED" "${SERVER_SHAPE[@]}" \
        --kernel-ref --update-weights --out "$OUT/server_e2e.json" ;;
    latency)
      piece latency "$B_LATENCY" "$PY" -m bench.server_latency --model "$SERVED" "${LATENCY_SHAPE[@]}" \
        --out "$OUT/latency.json" ;;
    rollout)
      piece rollout "$B_ROLLOUT" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 "$PY" -m bench.rollout \
        --models "$ROLLOUT_MODELS" "${ROLLOUT_SHAPE[@]}" --sync-models "$SYNC_MODELS" --out "$OUT/rollout.json" ;;
    *) echo "unknown piece $p: grpo | server_e2e | latency | rollout" >&2 ;;
  esac
done

echo "== summary ($SECONDS s)"
cat "$OUT/summary.txt"
"$PY" -m bench.e2e_summary "$OUT" 2>&1 | tee "$OUT/summary_numbers.txt"
