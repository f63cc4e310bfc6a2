"""A train.grpo run's step against its two long-sequence targets: the rollout's sampling rate beside the decode
roofline for its sequence lengths, and the learner's MFU inside the step.

    python -m bench.rollout_roofline --model qwen3-4b --prompts 8 --group 8 --prompt-tokens 16 \
        --metrics runs/x/metrics.jsonl --measure

The roofline is the bytes a decode step must read, over the device's copy bandwidth (`--measure`: bench._timing's
ceilings on this device, so run it in the same lease as the training run; or `--bandwidth-gbps`). Each step reads
every weight once (the lm_head; a tied embedding counts once) and, for each sequence decoding, its KV cache up to its
position. Over a rollout of N = prompts x group sequences of L new tokens after prompts of p tokens, with S of them
decoding together (the row's rollout_sequences_mean, what the KV page budget admitted):

    bytes = (N x L / S) x weights + N x (L x p + L^2 / 2) x KV bytes per position

and the roofline rate is N x L tokens over bytes / bandwidth; the row's rollout_decode_tokens_per_s (prefill and
any re-prefill of preempted sequences included) is set beside it. The learner's MFU is the row's learner_pass_mfu
(rlkjax.core.flops, the one MFU definition). Targets: rollout within 1.25x of its roofline, learner >= 40% MFU.
"""

import argparse
import dataclasses
import json

import jax.numpy as jnp

from rlkjax.core.config import LoraConfig, ModelConfig
from train import memory

ROLLOUT_TARGET = 1.25  # measured time over the roofline's, at most
LEARNER_TARGET = 0.40  # MFU, at least


def weight_bytes(cfg: ModelConfig) -> int:
    """What one decode step reads of the weights: every one once; an untied embedding table is gathered by rows."""
    untied = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    return (memory.parameter_count(cfg) - untied) * jnp.dtype(cfg.dtype).itemsize


def roofline(cfg: ModelConfig, sequences: int, prompt: float, new: float, together: float, bandwidth: float) -> dict:
    """The decode roofline of a rollout (see the module's docstring): its bytes, seconds and tokens per second."""
    per_position = memory.kv_page_bytes(cfg) / memory.PAGE_SIZE
    steps = sequences * new / together
    total = steps * weight_bytes(cfg) + sequences * (new * prompt + new * new / 2) * per_position
    seconds = total / bandwidth
    return {"bytes": total, "decode_steps": steps, "seconds": seconds, "tokens_per_s": sequences * new / seconds}


def rows(cfg: ModelConfig, metrics: list[dict], sequences: int, prompt: int, bandwidth: float) -> list[dict]:
    out = []
    for r in metrics:
        ideal = roofline(cfg, sequences, prompt, r["completion_tokens_mean"], r["rollout_sequences_mean"], bandwidth)
        out.append(
            {
                "step": r["step"],
                "sequences_together": r["rollout_sequences_mean"],
                "completion_tokens_mean": r["completion_tokens_mean"],
                "roofline_tokens_per_s": ideal["tokens_per_s"],
                "measured_tokens_per_s": r["rollout_decode_tokens_per_s"],
                "rollout_over_roofline": ideal["tokens_per_s"] / r["rollout_decode_tokens_per_s"],
                "learner_pass_mfu": r.get("learner_pass_mfu"),
            }
        )
    return out


def table(found: list[dict], bandwidth: float) -> str:
    lines = [
        f"copy bandwidth {bandwidth / 1e9:,.0f} GB/s; targets: rollout <= {ROLLOUT_TARGET}x its roofline, "
        f"learner >= {LEARNER_TARGET:.0%} MFU",
        "",
        "| step | sequences together | new tokens (mean) | roofline tokens/s | measured | rollout / roofline "
        "| learner MFU |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in found:
        mfu = "" if r["learner_pass_mfu"] is None else f"{r['learner_pass_mfu']:.1%}"
        lines.append(
            f"| {r['step']} | {r['sequences_together']:.1f} | {r['completion_tokens_mean']:,.0f} "
            f"| {r['roofline_tokens_per_s']:,.0f} | {r['measured_tokens_per_s']:,.0f} "
            f"| {r['rollout_over_roofline']:.2f}x | {mfu} |"
        )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", help="the run's model preset")
    ap.add_argument("--lora-rank", type=int, default=0, help="the run's --lora-rank (its adapters are read too)")
    ap.add_argument("--prompts", type=int, default=8, help="the run's --prompts-per-step")
    ap.add_argument("--group", type=int, default=8, help="the run's --group-size")
    ap.add_argument("--prompt-tokens", type=int, default=16, help="the run's prompt length (--max-prompt-tokens)")
    ap.add_argument("--metrics", required=True, help="the run's metrics.jsonl")
    ap.add_argument("--bandwidth-gbps", type=float, help="the device's copy bandwidth, GB/s (read + written)")
    ap.add_argument("--measure", action="store_true", help="measure the copy bandwidth on this device instead")
    ap.add_argument("--out", help="also write the rows and the bandwidth as JSON here")
    args = ap.parse_args()
    if (args.bandwidth_gbps is None) == (not args.measure):
        ap.error("give one of --bandwidth-gbps and --measure")
    if args.measure:
        from bench._timing import ceilings

        bandwidth = ceilings(5)["copy_bandwidth_Bps"]
    else:
        bandwidth = args.bandwidth_gbps * 1e9
    cfg = ModelConfig.preset(args.model)
    if args.lora_rank:
        cfg = dataclasses.replace(cfg, lora=LoraConfig(rank=args.lora_rank))
    metrics = [json.loads(line) for line in open(args.metrics)]
    found = rows(cfg, metrics, args.prompts * args.group, args.prompt_tokens, bandwidth)
    print(table(found, bandwidth))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"copy_bandwidth_Bps": bandwidth, "rows": found}, f, indent=2)


if __name__ == "__main__":
    main()
