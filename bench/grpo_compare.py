"""GRPO step time, strict vs fast, side by side in one run (GPU).

For each model shape runs a few GRPO steps with `--verify-logprobs` in both numerics and reports
the step split (rollout / learn / sync / host: the rest of the step, i.e. rewards, packing and the
learner's verify pass over the sampled tokens), rollout and learner tokens/s, MFU of the learner pass
and of the whole GRPO step (train.grpo's own metrics, its FLOPs from rlkjax.core.flops; none on a device
without a known peak, such as the CPU) and the sampler/learner mismatch (strict must be 0).

    python -m bench.grpo_compare --models qwen3-0.6b,qwen3-1.7b --steps 3 --out bench/results/grpo.json

`--lora-ranks 0,16` runs each also with LoRA adapters of rank 16 on every projection (0: full parameters), whose
MFU counts what LoRA computes (rlkjax.core.flops: no weight gradient of the frozen base).

The report is rewritten after every run, so a run cut short keeps the rows it finished.
"""

import dataclasses
import json
import tempfile

import numpy as np

import rlkjax
from bench import _flags
from bench._report import new_report, save_report
from rlkjax.core import flops
from rlkjax.entry_config import ModelSource, Runtime
from train import grpo
from train.config import Lora, Optimiser


def percent(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def print_table(results):
    print(
        f"\n{'model':11} {'numerics':8} {'LoRA':>4} {'step s':>7} {'rollout':>8} {'learn':>7} {'sync':>6} {'host':>6} "
        f"{'learn tok/s':>11} {'MFU learner pass':>16} {'MFU GRPO step':>13} {'bits differ':>11} {'max|d|':>8}"
    )
    for r in results:
        print(
            f"{r['model']:11} {r['numerics']:8} {r['lora_rank']:4d} {r['step_s']:7.2f} {r['rollout_s']:8.2f} "
            f"{r['learn_s']:7.2f} {r['sync_s']:6.3f} {r['host_s']:6.2f} {r['learner_tokens_per_s']:11.0f} "
            f"{percent(r['learner_pass_mfu']):>16} {percent(r['grpo_step_mfu']):>13} "
            f"{r['mismatch_tokens']:5d}/{r['tokens_compared']:<6d} {r['mismatch_max']:8.3g}"
        )


def run(name, numerics, args, lora_rank=0):
    """One train.grpo run (verify on) and its row; lora_rank > 0 trains LoRA adapters of that rank."""
    config = grpo.GRPOConfig(
        lora=Lora(lora_rank=lora_rank),
        source=ModelSource(name),
        runtime=Runtime(numerics=numerics),
        steps=args.steps,
        prompts_per_step=args.prompts,
        group_size=args.group,
        max_new_tokens=args.new_tokens,
        verify_every=1,
        micro_batch_tokens=args.micro_batch_tokens,
        remat=args.remat,
        optimiser=Optimiser(learning_rate=1e-6),
        out=tempfile.mkdtemp(prefix=f"grpo_{name}_{numerics}_r{lora_rank}_"),
        progress=False,
        checkpoint_every=10**6,
    )
    result = grpo.train(config)
    rows = result["history"][1:] or result["history"]  # the first step compiles

    def mean(key, rows=rows):
        values = [r[key] for r in rows if r.get(key) is not None]
        return float(np.mean(values)) if values else None

    trained = args.prompts * args.group * args.new_tokens
    row = {
        "model": name,
        "numerics": numerics,
        "lora_rank": lora_rank,
        "matmul_params": flops.matmul_params(rlkjax.ModelConfig.preset(name)),
        "adapter_params": flops.adapter_params(
            dataclasses.replace(rlkjax.ModelConfig.preset(name), lora=rlkjax.LoraConfig(rank=lora_rank))
        )
        if lora_rank
        else 0,
        "step_s": mean("step_s"),
        "rollout_s": mean("rollout_s"),
        "verify_s": mean("verify_s"),
        "learn_s": mean("learn_s"),
        "update_s": mean("update_s"),
        "sync_s": mean("sync_s"),
        "host_s": mean("host_s"),
        "rollout_tokens_per_s": trained / mean("rollout_s"),
        "learner_tokens_per_s": trained / mean("learn_s"),
        "learner_pass_mfu": mean("learner_pass_mfu"),
        "grpo_step_mfu": mean("grpo_step_mfu"),
        "mismatch_tokens": int(sum(r["tokens_bits_differ"] for r in result["history"])),
        "tokens_compared": int(sum(r.get("tokens_compared", 0) for r in result["history"])),
        "mismatch_max": max(r["max_abs_delta"] for r in result["history"]),
        "mismatch_mean": float(np.mean([r["mean_abs_delta"] for r in result["history"]])),
        "mismatch_k3": float(np.mean([r["k3_kl"] for r in result["history"]])),
        "first_ratio_min": min(r["ratio_min"] for r in result["history"]),
        "first_ratio_max": max(r["ratio_max"] for r in result["history"]),
    }
    peaks = [max(r["peak_bytes_per_device"]) for r in result["history"] if "peak_bytes_per_device" in r]
    if peaks:  # since the start of the run, over the learner and sampler devices
        row["peak_memory_GiB"] = max(peaks) / 2**30
    return row


def main():
    ap = _flags.parser(__doc__)
    _flags.add_models(ap, "qwen3-0.6b,qwen3-1.7b")
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per run; the first (compilation) is not averaged")
    ap.add_argument("--prompts", type=int, default=16, help="P prompts per step")
    ap.add_argument("--group", type=int, default=8, help="G completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens per completion")
    ap.add_argument(
        "--micro-batch-tokens",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help="padded tokens a learner device holds per micro-batch (train.grpo --micro-batch-tokens), or auto",
    )
    ap.add_argument("--remat", choices=["auto", "off", "qkv", "on"], default="auto", help="train.grpo --remat")
    ap.add_argument("--numerics", default="fast,strict", help="comma-separated: fast, strict or both")
    ap.add_argument("--lora-ranks", default="0", help="comma-separated LoRA ranks to run (0: full-parameter training)")
    _flags.add_out(ap)
    args = ap.parse_args()
    grpo.claim_device_memory()  # as `python -m train.grpo` does
    report = new_report("bench.grpo_compare")
    for name in args.models.split(","):
        for numerics in args.numerics.split(","):
            for rank in (int(r) for r in args.lora_ranks.split(",")):
                row = run(name, numerics, args, rank)
                report["results"].append(row)
                print(json.dumps(row), flush=True)
                save_report(report, args.out)
    print_table(report["results"])
    save_report(report, args.out)


if __name__ == "__main__":
    main()
