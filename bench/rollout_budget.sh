#!/usr/bin/env bash
# train.grpo's rollout under a KV page budget, on one GPU: tests/test_rollout_budget.py compiled (bits equal between
# a budget that preempts and an ample one, in-process and through a server, single- and multi-turn), then the same
# GRPO steps twice with random weights and --ignore-eos (every completion to full length): with the KV cache the
# memory plan gives (ample: every sequence fits, nothing preempted) and with --rollout-kv-gib $TIGHT_GIB (a fraction
# of them at once: preempted and prefilled again). summary.json compares them: every step's reward, loss and
# gradient norm must be the same numbers and the mismatch 0, beside each run's concurrency, preemptions, decode
# rate, rollout seconds and measured rollout memory against the plan (memory_plan_*.md).
#
#   bash bench/rollout_budget.sh           # on the GPU machine (repo root or anywhere); writes $OUT
#   bash bench/rollout_budget.sh dry-run   # the same at qwen3-tiny shapes on the CPU, no pytest (checks the script)
#
# Environment: MODEL (qwen3-1.7b), PROMPTS (8), GROUP (8), NEW_TOKENS (2048), TIGHT_GIB (4: Qwen3-1.7B's 2,064-token
# sequences take 0.22 GiB each, so 18 of the 64 fit at once), STEPS (2), PY (python3), OUT (/tmp/out).
set -uo pipefail
OUT=${OUT:-/tmp/out}; PY=${PY:-python3}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [ "${1:-}" = dry-run ]; then
  # 7 pages of qwen3-tiny (4 KiB each): one 56-token sequence takes 4
  export JAX_PLATFORMS=cpu MODEL=qwen3-tiny PROMPTS=2 GROUP=4 NEW_TOKENS=40 TIGHT_GIB=0.0000267028808594 STEPS=2
fi
MODEL=${MODEL:-qwen3-1.7b}; PROMPTS=${PROMPTS:-8}; GROUP=${GROUP:-8}; NEW_TOKENS=${NEW_TOKENS:-2048}
TIGHT_GIB=${TIGHT_GIB:-4}; STEPS=${STEPS:-2}
ARGS=(--model "$MODEL" --task synthetic-token-ids --steps "$STEPS" --prompts-per-step "$PROMPTS"
  --group-size "$GROUP" --max-new-tokens "$NEW_TOKENS" --max-prompt-tokens 16 --ignore-eos --verify-every 1
  --checkpoint-every 0 --no-progress)
"$PY" -m bench._report --command "bash bench/rollout_budget.sh $*: python -m train.grpo ${ARGS[*]}" \
  --out "$OUT/env.json" > /dev/null
status=0
if [ "${1:-}" != dry-run ]; then
  # No preallocation: the test process and the server it starts share the GPU (tiny models, little memory each).
  XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m pytest -n 0 -q -m "not demo" tests/test_rollout_budget.py 2>&1 |
    tee "$OUT/pytest_rollout_budget.log"
  status=${PIPESTATUS[0]}
fi
for run in ample tight; do
  extra=(); [ "$run" = tight ] && extra=(--rollout-kv-gib "$TIGHT_GIB")
  dir=$(mktemp -d)/$run
  "$PY" -m train.grpo "${ARGS[@]}" "${extra[@]}" --out "$dir" > "$OUT/${run}_train.log" 2>&1 || status=1
  cp "$dir/metrics.jsonl" "$OUT/${run}_metrics.jsonl" 2>/dev/null
  plan=(--model "$MODEL" --gpus 1 --prompts "$PROMPTS" --group "$GROUP" --new-tokens "$NEW_TOKENS" --prompt-tokens 16)
  [ "$run" = tight ] && plan+=(--kv-gib "$TIGHT_GIB")
  [ -s "$OUT/${run}_metrics.jsonl" ] && "$PY" -m bench.memory_plan "${plan[@]}" --metrics "$OUT/${run}_metrics.jsonl" \
    > "$OUT/memory_plan_$run.md" 2>&1
done
"$PY" - "$OUT" <<'EOF' || status=1
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {r: [json.loads(line) for line in (out / f"{r}_metrics.jsonl").read_text().splitlines()] for r in ("ample", "tight")}
same = ("reward_mean", "loss", "grad_norm", "completion_tokens_mean")
fields = ("rollout_s", "rollout_sequences_mean", "rollout_sequences_peak", "rollout_preemptions",
          "rollout_preempted_tokens", "rollout_decode_tokens_per_s", "peak_bytes_rollout", "tokens_bits_differ")
summary = {
    "same_numbers": all(a[k] == b[k] for a, b in zip(*runs.values(), strict=True) for k in same),
    "mismatch_zero": all(r["tokens_bits_differ"] == 0 for rows in runs.values() for r in rows),
    "tight_preempted": all(r["rollout_preemptions"] > 0 for r in runs["tight"]),
    "steps": {name: [{k: r.get(k) for k in ("step", *same, *fields)} for r in rows] for name, rows in runs.items()},
}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps({k: v for k, v in summary.items() if k != "steps"}))
sys.exit(0 if summary["same_numbers"] and summary["mismatch_zero"] and summary["tight_preempted"] else 1)
EOF
exit "$status"
