#!/usr/bin/env bash
# The reasoning-length measurements on one GPU, one after another in a detached session (together they outlast
# one command), each into its own folder of $RUN:
#   train/     train.grpo, Qwen3-1.7B, P8 x G8 x 4096 new tokens, --ignore-eos, no memory flag (the plan chooses),
#              $STEPS steps, every step verified (bench/seed_run.sh), and bench.memory_plan's estimate beside the
#              peaks it measured per phase;
#   pytest/    pytest -m gpu: the contract compiled;
#   decode/    bench/long_context_decode.sh sweep speed1: a decode step's attention alone at 8B heads (KV split size
#              x the merge kernel's launch, the earlier launch beside, bits compared), then Qwen3-8B decode at
#              batch 1, contexts 2k to 32k, strict beside fast, share of the HBM roofline;
#   mismatch/  bench.mismatch: Qwen3-8B shapes, sampler against learner by completion position up to 8k tokens,
#              fast numerics beside strict, with the plot.
# In that order: what a shorter lease cuts is the last.
#
#   bash bench/reasoning_gpu.sh start          # starts it (setsid) and returns
#   bash bench/reasoning_gpu.sh wait SECONDS   # waits up to SECONDS, then packs what is written into
#                                              #   $OUT/reasoning_gpu.tar.gz and prints each part's state
# Environment: RUN (/tmp/reasoning_gpu), STEPS (3), MISMATCH_BATCH (8), PY (python3), OUT (/tmp/out).
set -uo pipefail
ACTION=${1:?usage: bash bench/reasoning_gpu.sh start | wait SECONDS}
OUT=${OUT:-/tmp/out}; RUN=${RUN:-/tmp/reasoning_gpu}; PY=${PY:-python3}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

sweep() {
  mkdir -p "$RUN/train" "$RUN/pytest" "$RUN/mismatch" "$RUN/decode"
  "$PY" -m bench._report --command "bash bench/reasoning_gpu.sh start" --out "$RUN/env.json" > /dev/null
  RUN="$RUN/train/run" OUT="$RUN/train" MODEL=qwen3-1.7b STEPS="${STEPS:-3}" PROMPTS=8 GROUP=8 NEW_TOKENS=4096 \
    IGNORE_EOS=1 VERIFY_EVERY=1 PY="$PY" bash bench/seed_run.sh start > "$RUN/train/start.log" 2>&1
  RUN="$RUN/train/run" OUT="$RUN/train" PY="$PY" bash bench/seed_run.sh wait 3600 > "$RUN/train/wait.log" 2>&1
  # the plan beside the peaks measured, at the settings the run chose (train.log's "memory plan:" line)
  read -r -a chose <<< "$(grep -o -- '--moments [a-z]* --remat [a-z]* --micro-batch-tokens [0-9]*' "$RUN/train/train.log" | head -n 1)"
  kv=$(grep -o 'rollout KV cache [0-9]* pages ([0-9.]* GiB)' "$RUN/train/train.log" | head -n 1 | grep -o '[0-9.]* GiB' | cut -d' ' -f1)
  [ -n "$kv" ] && chose+=(--kv-gib "$kv")
  "$PY" -m bench.memory_plan --model qwen3-1.7b --gpus 1 --prompts 8 --group 8 --new-tokens 4096 --prompt-tokens 16 \
    "${chose[@]}" --metrics "$RUN/train/metrics.jsonl" > "$RUN/train/memory_plan.md" 2>&1
  # the files that hold GPU tests (the others import the openai client, which the GPU image lacks)
  "$PY" -m pytest -m gpu -q -n 0 tests/test_gpu.py tests/test_executable_cache.py tests/test_learner_slice.py \
    > "$RUN/pytest/pytest_gpu.log" 2>&1; echo $? > "$RUN/pytest/exit"
  OUT="$RUN/decode" PY="$PY" bash bench/long_context_decode.sh sweep speed1 > "$RUN/decode/log" 2>&1
  "$PY" -m bench.mismatch --models qwen3-8b --batch "${MISMATCH_BATCH:-8}" --new-tokens 8192 --min-prompt 16 \
    --max-prompt 128 --repeats 1 --buckets 0,256,512,1024,2048,4096,8192 --score-batch 1 \
    --plot "$RUN/mismatch/by_position.png" --out "$RUN/mismatch/by_position.json" > "$RUN/mismatch/log" 2>&1
}

case "$ACTION" in
  start)
    rm -rf "$RUN"; mkdir -p "$RUN"
    export -f sweep; export RUN PY
    setsid nohup bash -c "sweep; touch '$RUN/ended'" > "$RUN/sweep.log" 2>&1 < /dev/null &
    echo "started: $RUN" ;;
  wait)
    deadline=$((SECONDS + ${2:?wait SECONDS}))
    while [ ! -f "$RUN/ended" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 5; done
    tar -czf "$OUT/reasoning_gpu.tar.gz" -C "$(dirname "$RUN")" "$(basename "$RUN")" --exclude run/checkpoints
    [ -f "$RUN/ended" ] && echo "ended" || echo "running"
    for part in train pytest decode mismatch; do echo "== $part"; tail -n 4 "$RUN/$part"/*log* 2>/dev/null; done ;;
  *) echo "usage: bash bench/reasoning_gpu.sh start | wait SECONDS" >&2; exit 2 ;;
esac
