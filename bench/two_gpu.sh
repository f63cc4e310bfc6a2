#!/usr/bin/env bash
# train.grpo on one host with 2 GPUs, one piece per command (each under `timeout`, so a piece fits a
# 10-minute slot):
#
#   bash bench/two_gpu.sh strict STEPS     # Qwen3-8B shapes, strict, verify on: FSDP learner over both GPUs,
#   bash bench/two_gpu.sh fast STEPS       #   samplers on both, P16 x G8, 256 new tokens; the same with --numerics fast
#   bash bench/two_gpu.sh processes STEPS  # two processes (one per GPU) vs one process on both GPUs, at Qwen3-0.6B
#                                          #   widths (PROCESS_MODEL) with non-zero gradients: final weights, AdamW
#                                          #   state, final_hf and metrics compared as bits
#   bash bench/two_gpu.sh layouts STEPS    # layouts that differ, strict, verify on: learner 0,1 + sampler 0;
#                                          #   learner 0 + samplers 0,1; learner 0 + sampler 1 (LAYOUT_MODEL)
#   bash bench/two_gpu.sh dry-run [PIECE]  # every piece (or one) at tiny shapes on 2 x 2 fake CPU devices (checks
#                                          #   the script)
#
# Writes to $OUT (default /tmp/out): env.json (provenance), <piece>.log, <piece>.json (bench/two_gpu.py's summary
# or comparison) and the run's metrics.jsonl / plot.png; checkpoints and final_hf stay in $RUNS (default /tmp/two_gpu_runs: 8B ones are
# 16 GB). Environment: TIMEOUT (seconds per piece, default 540), MICRO_BATCH_TOKENS (default auto: the memory
# plan's choice, see `python -m bench.memory_plan`), REMAT (auto, on or off: train.grpo --remat),
# PY (default python3), BIG_MODEL (default qwen3-8b), LAYOUT_MODEL (default qwen3-0.6b), PROCESS_LIKE (default
# qwen3-0.6b) and PROCESS_LAYERS (default 4): the processes piece's model, random weights with those widths and
# a byte vocabulary (bench/two_gpu.py model: with Qwen3's own vocabulary a random model samples no text, every
# reward is 0 and every gradient zero; with bytes the lowercase task's rewards vary, so the cross-GPU gradient
# sum is exercised), TASK (default lowercase).
set -uo pipefail
PIECE=${1:?usage: bash bench/two_gpu.sh strict|fast|processes|layouts STEPS, or bash bench/two_gpu.sh dry-run}
STEPS=${2:-3}
OUT=${OUT:-/tmp/out}; RUNS=${RUNS:-/tmp/two_gpu_runs}; PY=${PY:-python3}; TIMEOUT=${TIMEOUT:-540}
mkdir -p "$OUT" "$RUNS"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# NVLink multicast stays off for every process started here (NCCL's NVLS, PyTorch's and NVSHMEM's).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

GPU_PIECES=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.95}  # JAX takes 75% of a GPU by default; 8B needs more
if [ "$PIECE" = dry-run ]; then  # every piece at tiny shapes, 2 fake CPU devices per process
  export XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu
  BIG_MODEL=qwen3-tiny PROCESS_LIKE=qwen3-tiny LAYOUT_MODEL=qwen3-tiny GPU_PIECES=0
  SHAPE_BIG=(--prompts-per-step 4 --group-size 2 --max-new-tokens 8 --max-prompt-tokens 32)
  SHAPE_SMALL=(--prompts-per-step 4 --group-size 2 --max-new-tokens 4 --max-prompt-tokens 32)
  STEPS=2
else
  SHAPE_BIG=(--prompts-per-step 16 --group-size 8 --max-new-tokens 256 --max-prompt-tokens 64)
  SHAPE_SMALL=(--prompts-per-step 8 --group-size 4 --max-new-tokens 32 --max-prompt-tokens 64)
fi
BIG_MODEL=${BIG_MODEL:-qwen3-8b}; LAYOUT_MODEL=${LAYOUT_MODEL:-qwen3-0.6b}
PROCESS_LIKE=${PROCESS_LIKE:-qwen3-0.6b}; PROCESS_LAYERS=${PROCESS_LAYERS:-4}
COMMON=(--learner-devices 0,1 --sampler-devices 0,1 --verify-every 1 --no-progress)

record_env() {  # provenance: command, date, commit, hardware through JAX, versions
  "$PY" -m bench._report --command "bash bench/two_gpu.sh $*" --out "$OUT/env.json" > /dev/null
}

big() {  # $1: strict | fast
  local run="$RUNS/big_$1"; rm -rf "$run"
  timeout -k 30 "$TIMEOUT" "$PY" -m train.grpo --model "$BIG_MODEL" "${SHAPE_BIG[@]}" "${COMMON[@]}" --task "${TASK:-lowercase}" --numerics "$1" \
    --steps "$STEPS" --micro-batch-tokens "${MICRO_BATCH_TOKENS:-auto}" --remat "${REMAT:-auto}" --learning-rate 1e-6 --checkpoint-every 0 --out "$run" \
    > "$OUT/big_$1.log" 2>&1
  echo "big_$1: exit $?" | tee -a "$OUT/big_$1.log"
  cp "$run/metrics.jsonl" "$OUT/big_$1.metrics.jsonl" 2>/dev/null; cp "$run/plot.png" "$OUT/big_$1.png" 2>/dev/null
  "$PY" -m bench.two_gpu summarize "$run" --out "$OUT/big_$1.json" >> "$OUT/big_$1.log" 2>&1
  cat "$OUT/big_$1.json" 2>/dev/null
}

processes() {
  local one="$RUNS/one_process" two="$RUNS/two_processes" model="$RUNS/process_model"; rm -rf "$one" "$two" "$model"
  "$PY" -m bench.two_gpu model "$model" --like "$PROCESS_LIKE" --layers "$PROCESS_LAYERS" || return 1
  local flags=(--model "$model" --tokenizer bytes "${SHAPE_SMALL[@]}" "${COMMON[@]}" --task "${TASK:-lowercase}"
               --steps "$STEPS" --warmup-steps 0 --checkpoint-every "$STEPS")
  local port; port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  {
    echo "== one process on both devices"
    timeout -k 30 "$TIMEOUT" "$PY" -m train.grpo "${flags[@]}" --out "$one"; echo "one process: exit $?"
    echo "== two processes, one device each (coordinator 127.0.0.1:$port)"
    local pids=() i
    for i in 1 0; do  # one device per process (set for that process only: later pieces see both)
      local one_device=(XLA_FLAGS=--xla_force_host_platform_device_count=1)
      if [ "$GPU_PIECES" = 1 ]; then one_device=(CUDA_VISIBLE_DEVICES=$i); fi
      env "${one_device[@]}" timeout -k 30 "$TIMEOUT" "$PY" -m train.grpo "${flags[@]}" --out "$two" \
        --coordinator "127.0.0.1:$port" --num-processes 2 --process-id "$i" > "$OUT/process_$i.log" 2>&1 &
      pids+=($!)
    done
    for i in "${pids[@]}"; do wait "$i"; echo "process pid $i: exit $?"; done
    "$PY" -m bench.two_gpu compare "$one" "$two" --out "$OUT/processes.json"; echo "compare: exit $?"
  } > "$OUT/processes.log" 2>&1
  cp "$one/metrics.jsonl" "$OUT/one_process.metrics.jsonl" 2>/dev/null
  cp "$two/metrics.jsonl" "$OUT/two_processes.metrics.jsonl" 2>/dev/null
  tail -n 40 "$OUT/processes.log"
}

layouts() {  # the sampler and the learner on different devices (both on both: the big pieces)
  local name learner sampler run
  for spec in "l01_s0 0,1 0" "l0_s01 0 0,1" "l0_s1 0 1"; do
    read -r name learner sampler <<< "$spec"
    run="$RUNS/layout_$name"; rm -rf "$run"
    timeout -k 30 "$TIMEOUT" "$PY" -m train.grpo --model "$LAYOUT_MODEL" "${SHAPE_SMALL[@]}" --task "${TASK:-lowercase}" \
      --learner-devices "$learner" --sampler-devices "$sampler" --verify-every 1 --no-progress --steps "$STEPS" \
      --checkpoint-every 0 --out "$run" > "$OUT/layout_$name.log" 2>&1
    echo "layout $name (learner $learner, sampler $sampler): exit $?" | tee -a "$OUT/layouts.log"
    "$PY" -m bench.two_gpu summarize "$run" --out "$OUT/layout_$name.json" >> "$OUT/layout_$name.log" 2>&1
    grep -E '"(steps|logprobs_compared|logprobs_bits_differ|first_update_ratio_min|first_update_ratio_max)"' \
      "$OUT/layout_$name.json" | tr -d '\n ' | tee -a "$OUT/layouts.log"; echo | tee -a "$OUT/layouts.log"
  done
}

record_env "$@"
case "$PIECE" in
  strict|fast) big "$PIECE" ;;
  processes) processes ;;
  layouts) layouts ;;
  dry-run)
    case "${2:-all}" in
      strict|fast) big "$2" ;;
      processes) processes ;;
      layouts) layouts ;;
      all) big strict; big fast; processes; layouts ;;
      *) echo "unknown piece $2: strict | fast | processes | layouts" >&2; exit 2 ;;
    esac ;;
  *) echo "unknown piece $PIECE: strict | fast | processes | layouts | dry-run" >&2; exit 2 ;;
esac
