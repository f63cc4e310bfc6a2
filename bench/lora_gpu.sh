#!/usr/bin/env bash
# LoRA on one GPU: the compiled contract, a LoRA step beside a full-parameter one, and a model trained with LoRA
# (Qwen3-8B on an H100, P16 x G8; Qwen3-32B on an H200: MODEL=qwen3-32b PROMPTS=8).
# Usage (repo root, on a one-GPU machine): bash bench/lora_gpu.sh; everything goes to $OUT, part by part as
# PARTS names them ("pytest compare train" by default):
#   env.json                  provenance (bench._report)
#   pytest_gpu_lora.log       pytest: tests/test_gpu.py -k lora: sampled == scored bits with non-zero adapters
#   grpo_compare_lora.json    compare: qwen3-1.7b, strict, full parameters vs LoRA rank 16: step split, tokens/s,
#                             MFU (LoRA counted as rlkjax.core.flops counts it), mismatch, peak memory
#   lora_run/metrics.jsonl    train: train.grpo --model $MODEL (qwen3-8b) --lora-rank 16 (random weights),
#                             P$PROMPTS (16) x G8 x 256, $STEPS steps (50): mismatch, ratio, MFU, per-phase peaks;
#                             lora_run/train.log its log; lora_run_plan.md the memory plan beside those peaks
set -uo pipefail
OUT=${OUT:-/tmp/out}; PY=${PY:-python3}; PARTS=${PARTS:-pytest compare train}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SETTING="PARTS='$PARTS' MODEL=${MODEL:-qwen3-8b} PROMPTS=${PROMPTS:-16} STEPS=${STEPS:-50}"
"$PY" -m bench._report --command "$SETTING bash bench/lora_gpu.sh" --out "$OUT/env.json"
status=0
for part in $PARTS; do
  case "$part" in
    pytest)
      "$PY" -m pytest -m gpu -q -n 0 tests/test_gpu.py -k lora > "$OUT/pytest_gpu_lora.log" 2>&1 || status=1 ;;
    compare)
      "$PY" -m bench.grpo_compare --models qwen3-1.7b --numerics strict --lora-ranks 0,16 --steps 4 \
        --out "$OUT/grpo_compare_lora.json" || status=1 ;;
    train)
      mkdir -p "$OUT/lora_run"
      "$PY" -m train.grpo --model "${MODEL:-qwen3-8b}" --task synthetic-token-ids --lora-rank 16 \
        --steps "${STEPS:-50}" --prompts-per-step "${PROMPTS:-16}" --group-size 8 --max-new-tokens 256 \
        --max-prompt-tokens 128 \
        --checkpoint-every 0 --no-progress --out "$OUT/lora_run" > "$OUT/lora_run/train.log" 2>&1 || status=1
      "$PY" -m bench.memory_plan --model "${MODEL:-qwen3-8b}" --gpus 1 --prompts "${PROMPTS:-16}" --group 8 \
        --new-tokens 256 --prompt-tokens 128 --lora-rank 16 --train-log "$OUT/lora_run/train.log" \
        --metrics "$OUT/lora_run/metrics.jsonl" > "$OUT/lora_run_plan.md" || status=1
      rm -rf "$OUT/lora_run/final_hf" ;;  # the adapter of random weights: nothing to keep
    *) echo "unknown part $part (pytest, compare, train)" >&2; exit 2 ;;
  esac
done
exit "$status"
