#!/usr/bin/env bash
# Decode at long context on one GPU, in parts that each fit a 10-minute slot:
#   tests    the attention kernels compiled (merge launches keep the bits, a row alone equals its row in a
#            batch past several KV splits, chunked prefill + decode equal the whole pass)
#                                                                                    -> pytest_attention.log
#   contract the contract compiled at Qwen3-0.6B/8B shapes, prompts past 3 KV splits -> pytest_contract.log
#   speed1   Qwen3-8B decode tokens/s and share of the HBM roofline, batch 1, 2k/8k/16k/32k keys,
#            strict beside fast                                                      -> decode_8b_b1.json
#   speed16  the same at batch 16 (32k keys needs ~78 GB of KV cache: on an H100 that row records its error)
#                                                                                    -> decode_8b_b16.json
#   sweep    a decode step's attention alone at 8B heads, batch 1/16, 2k-32k keys: KV split size x the
#            merge kernel's launch, among them the merge as it ran before its loads went ahead; bits compared
#                                                                                    -> sweep_decode_attention.json
#   profile  per-kernel device time of an 8B decode step at batch 1 and 16k keys (attention_split,
#            attention_merge beside the matmuls)                                     -> profile_8b_b1_16k.json
# Usage (repo root, on the GPU machine): bash bench/long_context_decode.sh [part ...]; no part: all six.
# The baseline beside it: the sweep's second config is the merge as it was; for whole decode steps, run the
# speed1 and profile commands below on a checkout of the parent commit (its speed16 sizes one cache for the
# longest context: give it --contexts 2048,8192,16384 on an H100).
set -uo pipefail
OUT=${OUT:-/tmp/out}; PY=${PY:-python3}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
parts=${*:-tests contract speed1 speed16 sweep profile}
"$PY" -m bench._report --command "bash bench/long_context_decode.sh $parts" --out "$OUT/env.json"
status=0
decode() {  # batch, output name
    "$PY" -m bench.speed --only decode --models qwen3-8b --batches "$1" --contexts 2048,8192,16384,32768 \
        --steps 16 --repeats 3 --out "$OUT/$2" || status=1
}
for part in $parts; do
    case $part in
        tests)
            "$PY" -m pytest -q -m "not demo" tests/test_kernels.py -k attention 2>&1 | tee "$OUT/pytest_attention.log"
            [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
        contract)
            "$PY" -m pytest -q -m gpu tests/test_gpu.py -k past_kv_splits 2>&1 | tee "$OUT/pytest_contract.log"
            [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
        speed1) decode 1 decode_8b_b1.json ;;
        speed16) decode 16 decode_8b_b16.json ;;
        sweep) "$PY" -m bench.speed --only sweep --sweep decode_attention --repeats 3 \
            --out "$OUT/sweep_decode_attention.json" || status=1 ;;
        profile) "$PY" -m bench.profile --model qwen3-8b --batch 1 --context 16384 --steps 8 \
            --out "$OUT/profile_8b_b1_16k.json" || status=1 ;;
        *) echo "unknown part: $part (tests, contract, speed1, speed16, sweep, profile)" >&2; exit 2 ;;
    esac
done
exit "$status"
