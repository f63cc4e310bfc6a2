#!/usr/bin/env bash
# The long-sequence measurements on one GPU (reasoning lengths, the kernels behind them), in a detached session (together they outlast one command), each
# part into its own folder of $RUN, in the order PARTS names them (what a shorter lease cuts is the last):
#   pytest    pytest -m gpu: the contract compiled. Alone: beside another process its 8B tests run out of memory.
#   mismatch  bench.mismatch: Qwen3-8B shapes, sampler against learner by completion position up to 8k tokens,
#             fast numerics beside strict, with the plot.
#   lora      bench/lora_gpu.sh's train part: $LORA_MODEL (qwen3-8b) with LoRA rank 16, P$LORA_PROMPTS (16) x G8 x
#             256, $LORA_STEPS (50) steps.
#   train     train.grpo, $MODEL, P8 x G8 x $NEW_TOKENS new tokens, --ignore-eos, no memory flag (the plan
#             chooses), $STEPS steps, every step verified (bench/seed_run.sh), and bench.memory_plan's estimate
#             beside the peaks it measured per phase, and bench.rollout_roofline's targets (rollout against the
#             decode roofline at the copy bandwidth measured then, learner MFU).
#   learner   bench.speed's learner rows: the learner pass and train.grpo's one-device step for $MODEL at one row of
#             $NEW_TOKENS tokens, at each --remat level (off, qkv, on) side by side: what each recomputation
#             costs, MFU and compiled memory (a level that does not fit records its error).
#   decode    bench/long_context_decode.sh sweep speed1: decode attention alone at 8B heads, then Qwen3-8B decode
#             at batch 1, contexts 2k to 32k, strict beside fast, share of the HBM roofline.
#   kernels   the attention launch tests and the contract on the row-sums-as-products table, compiled.
#   attention bench.attention_long's forward rows: our launches and cuDNN's at 8 x 1024 to 1 x 32768 tokens.
#   attention_bwd  its forward-and-backward and decode rows.
#   peer      bench.learner_vs_peer, $MODEL, each B x T of $PEER_SHAPES ("8x1024 1x8192"), the peer compiled.
#   before    bench.speed's learner rows for $MODEL at those shapes from $BEFORE_TREE, an older checkout (also
#             timed beside ours in the attention parts).
#
#   bash bench/reasoning_gpu.sh start          # starts it (setsid) and returns
#   bash bench/reasoning_gpu.sh wait SECONDS   # waits up to SECONDS, then copies what is written (small files only:
#                                              #   no weights) into $OUT/reasoning_gpu.tar.gz; prints each part's state
# Environment: RUN (/tmp/reasoning_gpu), PARTS ("pytest mismatch train decode"), MODEL (qwen3-1.7b),
# NEW_TOKENS (4096), STEPS (3), LORA_MODEL (qwen3-8b), LORA_PROMPTS (16), LORA_STEPS (50), MISMATCH_BATCH (8),
# MISMATCH_TOKENS (8192), PEER_SHAPES ("8x1024 1x8192"), BEFORE_TREE (none), ATTENTION_ARGS (more flags of
# bench.attention_long),
# PY (python3), OUT (/tmp/out).
set -uo pipefail
ACTION=${1:?usage: bash bench/reasoning_gpu.sh start | wait SECONDS}
OUT=${OUT:-/tmp/out}; RUN=${RUN:-/tmp/reasoning_gpu}; PY=${PY:-python3}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

part_pytest() {
  # the files that hold GPU tests (the others import the openai client, which the GPU image lacks)
  "$PY" -m pytest -m gpu -q -n 0 tests/test_gpu.py tests/test_executable_cache.py \
    tests/test_learner_slice.py > "$RUN/pytest/pytest_gpu.log" 2>&1; echo $? > "$RUN/pytest/exit"
}

part_mismatch() {
  "$PY" -m bench.mismatch --models qwen3-8b --batch "${MISMATCH_BATCH:-8}" \
    --new-tokens "${MISMATCH_TOKENS:-8192}" --min-prompt 16 --max-prompt 128 --repeats 1 \
    --buckets "0,256,512,1024,2048,4096,${MISMATCH_TOKENS:-8192}" \
    --score-batch 1 --plot "$RUN/mismatch/by_position.png" --out "$RUN/mismatch/by_position.json" \
    > "$RUN/mismatch/log" 2>&1
}

part_lora() {
  OUT="$RUN/lora" PARTS=train MODEL="${LORA_MODEL:-qwen3-8b}" PROMPTS="${LORA_PROMPTS:-16}" STEPS="${LORA_STEPS:-50}" \
    PY="$PY" bash bench/lora_gpu.sh > "$RUN/lora/log" 2>&1
}

part_train() {
  local model=${MODEL:-qwen3-1.7b} new=${NEW_TOKENS:-4096} here="$RUN/train"  # seed_run copies its files here
  RUN="$here/run" OUT="$here" MODEL="$model" STEPS="${STEPS:-3}" PROMPTS=8 GROUP=8 NEW_TOKENS="$new" \
    IGNORE_EOS=1 VERIFY_EVERY=1 PY="$PY" bash bench/seed_run.sh start > "$here/start.log" 2>&1
  RUN="$here/run" OUT="$here" PY="$PY" bash bench/seed_run.sh wait 7200 > "$here/wait.log" 2>&1
  # the plan beside the peaks measured, at the settings the run chose on this GPU
  "$PY" -m bench.memory_plan --model "$model" --gpus 1 --prompts 8 --group 8 --new-tokens "$new" --prompt-tokens 16 \
    --train-log "$here/train.log" --metrics "$here/metrics.jsonl" > "$here/memory_plan.md" 2>&1
  # the two targets: the rollout beside its decode roofline (copy bandwidth measured now), the learner's MFU
  "$PY" -m bench.rollout_roofline --model "$model" --prompts 8 --group 8 --prompt-tokens 16 --measure \
    --metrics "$here/metrics.jsonl" --out "$here/roofline.json" > "$here/roofline.md" 2>&1
}

part_learner() {
  "$PY" -m bench.speed --only learner --learner-models "${MODEL:-qwen3-1.7b}" --learner-seqs "${NEW_TOKENS:-4096}" \
    --learner-tokens "${NEW_TOKENS:-4096}" --learner-sides strict,train --learner-remat off,qkv,on \
    --out "$RUN/learner/speed.json" > "$RUN/learner/log" 2>&1
}

part_kernels() {
  "$PY" -m pytest -q -n 0 -m "slow or not slow" tests/test_kernels.py tests/test_contract.py \
    -k "long_rows or tiles_per_program or chunked_equals_whole or row_sums" > "$RUN/kernels/log" 2>&1
}

attention_long() {  # sections, folder
  "$PY" -m bench.attention_long --sections "$1" ${BEFORE_TREE:+--before "$BEFORE_TREE/pallas_kernels/attention.py"} \
    ${ATTENTION_ARGS:-} --out "$RUN/$2/attention_long.json" > "$RUN/$2/log" 2>&1
}
part_attention() { attention_long forward attention; }
part_attention_bwd() { attention_long forward_backward,decode attention_bwd; }

part_peer() {
  for shape in ${PEER_SHAPES:-8x1024 1x8192}; do
    "$PY" -m bench.learner_vs_peer --models "${MODEL:-qwen3-1.7b}" --batch "${shape%x*}" --seq "${shape#*x}" \
      --variants compile --no-profile --time-limit-s 420 --out-dir "$RUN/peer/$shape" > "$RUN/peer/$shape.log" 2>&1
  done
}

part_before() {
  local here="$RUN/before"
  for shape in ${PEER_SHAPES:-8x1024 1x8192}; do
    (cd "${BEFORE_TREE:?an older checkout}" && PYTHONPATH="$PWD:${PYTHONPATH:-}" "$PY" -m bench.speed --only learner \
      --learner-models "${MODEL:-qwen3-1.7b}" --learner-seqs "${shape#*x}" --learner-tokens $(( ${shape%x*} * ${shape#*x} )) \
      --learner-sides strict --out "$here/speed_$shape.json") > "$here/$shape.log" 2>&1
  done
}

part_decode() {
  OUT="$RUN/decode" PY="$PY" bash bench/long_context_decode.sh sweep speed1 > "$RUN/decode/log" 2>&1
}

sweep() {
  "$PY" -m bench._report --command "PARTS='$PARTS' bash bench/reasoning_gpu.sh start" --out "$RUN/env.json" > /dev/null
  for part in $PARTS; do mkdir -p "$RUN/$part" && "part_$part"; done
}

case "$ACTION" in
  start)
    rm -rf "$RUN"; mkdir -p "$RUN"
    export PARTS=${PARTS:-pytest mismatch train decode}
    export -f sweep attention_long part_pytest part_mismatch part_lora part_train part_learner part_decode \
      part_kernels part_attention part_attention_bwd part_peer part_before; export RUN PY
    setsid nohup bash -c "sweep; touch '$RUN/ended'" > "$RUN/sweep.log" 2>&1 < /dev/null &
    echo "started: $RUN ($PARTS)" ;;
  wait)
    deadline=$((SECONDS + ${2:?wait SECONDS}))
    while [ ! -f "$RUN/ended" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 5; done
    # what was written, less anything over 16 MiB (weights, checkpoints) and the run folders' copies
    (cd "$(dirname "$RUN")" && find "$(basename "$RUN")" -type f -size -16M -not -path '*/run/*' -print0 |
      tar -czf "$OUT/reasoning_gpu.tar.gz" --null -T -)
    [ -f "$RUN/ended" ] && echo "ended" || echo "running"
    for part in pytest mismatch lora train learner decode kernels attention attention_bwd peer before; do
      [ -d "$RUN/$part" ] && { echo "== $part"; tail -n 4 "$RUN/$part"/*log* 2>/dev/null; }
    done ;;
  *) echo "usage: bash bench/reasoning_gpu.sh start | wait SECONDS" >&2; exit 2 ;;
esac
