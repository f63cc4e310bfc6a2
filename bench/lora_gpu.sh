#!/usr/bin/env bash
# LoRA on one GPU: the compiled contract, a LoRA step beside a full-parameter one, and Qwen3-8B with LoRA.
# Usage (repo root, on a one-GPU machine): bash bench/lora_gpu.sh; everything goes to $OUT:
#   env.json                  provenance (bench._report)
#   pytest_gpu_lora.log       tests/test_gpu.py -k lora: sampled == scored bits with non-zero adapters, compiled
#   grpo_compare_lora.json    qwen3-1.7b, strict, full parameters vs LoRA rank 16: step split, tokens/s, MFU
#                             (LoRA counted as rlkjax.core.flops counts it), mismatch, peak memory
#   lora8b/metrics.jsonl      train.grpo --model qwen3-8b --lora-rank 16 (random weights), 6 steps: mismatch,
#                             ratio, MFU, per-phase peaks; lora8b_plan.md the memory plan beside those peaks
set -uo pipefail
OUT=${OUT:-/tmp/out}; PY=${PY:-python3}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
"$PY" -m bench._report --command "bash bench/lora_gpu.sh" --out "$OUT/env.json"
"$PY" -m pytest -m gpu -q tests/test_gpu.py -k lora 2>&1 | tee "$OUT/pytest_gpu_lora.log"
status=${PIPESTATUS[0]}
"$PY" -m bench.grpo_compare --models qwen3-1.7b --numerics strict --lora-ranks 0,16 --steps 4 \
    --out "$OUT/grpo_compare_lora.json" || status=1
"$PY" -m train.grpo --model qwen3-8b --task synthetic-token-ids --lora-rank 16 --steps 6 --prompts-per-step 16 \
    --group-size 8 --max-new-tokens 256 --max-prompt-tokens 128 --checkpoint-every 0 --no-progress \
    --out "$OUT/lora8b" 2>&1 | tail -n 40
[ "${PIPESTATUS[0]}" = 0 ] || status=1
"$PY" -m bench.memory_plan --model qwen3-8b --gpus 1 --lora-rank 16 --metrics "$OUT/lora8b/metrics.jsonl" \
    > "$OUT/lora8b_plan.md" || status=1
rm -rf "$OUT/lora8b/final_hf"  # the adapter of random weights: nothing to keep
exit "$status"
