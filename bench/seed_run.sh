#!/usr/bin/env bash
# The seed's run on one GPU: train.grpo, Qwen3-8B shapes with random weights, strict, 200 steps, detached so it
# outlives the command that starts it; then polled until it ends.
#
#   bash bench/seed_run.sh start         # starts the run in its own session (setsid) and returns
#   bash bench/seed_run.sh wait SECONDS  # waits up to SECONDS for it to end, then copies what it has written
#                                        #   (metrics.jsonl, samples.jsonl, plot.png, train.log, summary.json) to $OUT
#   bash bench/seed_run.sh dry-run       # the same at qwen3-tiny shapes on the CPU, 3 steps (checks the script)
#
# The task is --task synthetic-token-ids: with random weights no text task's reward moves at 8B, while the
# fraction of sampled ids that are multiples of 64 does. Checkpoints are off: one of Qwen3-8B's holds 91.5 GiB
# (fp32 master weights and AdamW's moments), more than a 64 GiB disk. Environment: RUN (default /tmp/seed_run),
# MODEL (qwen3-8b), STEPS (200), PROMPTS (8), GROUP (8), NEW_TOKENS (256), PROMPT_TOKENS (16), IGNORE_EOS (0; 1 samples
# every new token, so lengths are real), MICRO_BATCH_TOKENS (auto), LR (2e-4), VERIFY_EVERY (20), PY (python3),
# OUT (/tmp/out).
set -uo pipefail
ACTION=${1:?usage: bash bench/seed_run.sh start | wait SECONDS | dry-run}
OUT=${OUT:-/tmp/out}; RUN=${RUN:-/tmp/seed_run}; PY=${PY:-python3}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

if [ "$ACTION" = dry-run ]; then
  export JAX_PLATFORMS=cpu MODEL=qwen3-tiny STEPS=3 PROMPTS=2 GROUP=4 NEW_TOKENS=8 MICRO_BATCH_TOKENS=64 VERIFY_EVERY=2
  export IGNORE_EOS=1
  RUN=$(mktemp -d)/seed_run
fi
ARGS=(--model "${MODEL:-qwen3-8b}" --task synthetic-token-ids --steps "${STEPS:-200}"
  --prompts-per-step "${PROMPTS:-8}" --group-size "${GROUP:-8}" --max-new-tokens "${NEW_TOKENS:-256}"
  --max-prompt-tokens "${PROMPT_TOKENS:-16}" --micro-batch-tokens "${MICRO_BATCH_TOKENS:-auto}"
  --learning-rate "${LR:-2e-4}" --verify-every "${VERIFY_EVERY:-20}" --checkpoint-every 0 --no-progress --out "$RUN")
[ "${IGNORE_EOS:-0}" = 1 ] && ARGS+=(--ignore-eos)

start() {
  rm -rf "$RUN"; mkdir -p "$RUN"
  "$PY" -m bench._report --command "bash bench/seed_run.sh start: python -m train.grpo ${ARGS[*]}" \
    --out "$RUN/env.json" > /dev/null
  # The clock starts before the interpreter does: start-up and compilation count in the run's wall time.
  setsid nohup bash -c "date +%s.%N > '$RUN/started'; '$PY' -m train.grpo ${ARGS[*]} > '$RUN/train.log' 2>&1;
    echo \$? > '$RUN/exit'; date +%s.%N > '$RUN/ended'" > /dev/null 2>&1 < /dev/null &
  echo "started: $RUN (train.log, metrics.jsonl)"
}

collect() {
  for f in env.json metrics.jsonl samples.jsonl plot.png train.log; do cp "$RUN/$f" "$OUT/" 2>/dev/null; done
  [ -s "$RUN/metrics.jsonl" ] && "$PY" -m bench.two_gpu summarize "$RUN" --out "$OUT/summary.json" > /dev/null
  if [ -f "$RUN/ended" ]; then
    echo "ended: exit $(cat "$RUN/exit"), wall $(awk "BEGIN {print $(cat "$RUN/ended") - $(cat "$RUN/started")}") s"
  fi
  echo "steps written: $(wc -l < "$RUN/metrics.jsonl" 2>/dev/null || echo 0)"
  tail -n 3 "$RUN/train.log" 2>/dev/null
}

wait_for() {  # $1: the most seconds to wait
  local deadline=$((SECONDS + $1))
  while [ ! -f "$RUN/ended" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 5; done
  collect
}

case "$ACTION" in
  start) start ;;
  wait) wait_for "${2:?wait SECONDS}" ;;
  dry-run) start && wait_for 900 && [ "$(cat "$RUN/exit")" = 0 ] ;;
  *) echo "unknown action $ACTION" >&2; exit 2 ;;
esac
