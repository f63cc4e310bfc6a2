"""Sampler-vs-learner logprob mismatch, strict vs fast, side by side in one run.

For each model shape: sample a batch of prompts x new tokens with `rlkjax.generate`, score the
finished sequences with `rlkjax.score` (the learner's pass), and compare the two logprobs of every
sampled token. Reports tokens compared, tokens whose float32 bits differ, max and mean |delta| and
the k3 estimate of KL(sampler || learner) (mean of r - 1 - log r, r = p_learner / p_sampler),
plus wall times.

    python -m bench.mismatch --models qwen3-0.6b,qwen3-8b --batch 64 --new-tokens 256 --out bench/results/x.json
"""

import json
import time

import numpy as np

import rlkjax
from bench import _flags
from bench._report import new_report, save_report
from rlkjax.core.mismatch import mismatch_stats


def run(cfg, params, prompts, new_tokens, temperature, numerics, chunk):
    t0 = time.perf_counter()
    comps = rlkjax.generate(
        params,
        cfg,
        prompts,
        max_tokens=new_tokens,
        temperature=temperature,
        seeds=list(range(len(prompts))),
        numerics=numerics,
        prefill_chunk_size=chunk,
    )
    t1 = time.perf_counter()
    scored = rlkjax.score(
        params,
        cfg,
        [p + c.tokens for p, c in zip(prompts, comps)],
        [len(p) for p in prompts],
        temperature=temperature,
        numerics=numerics,
    )
    t2 = time.perf_counter()
    stats = mismatch_stats(np.concatenate([c.logprobs for c in comps]), np.concatenate(scored))
    return stats | {"generate_s": t1 - t0, "score_s": t2 - t1}


def main():
    ap = _flags.parser(__doc__)
    _flags.add_models(ap, "qwen3-tiny")
    ap.add_argument("--batch", type=int, default=8, help="prompts per batch")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens sampled per prompt")
    ap.add_argument("--min-prompt", type=int, default=16, help="shortest random prompt")
    ap.add_argument("--max-prompt", type=int, default=128, help="longest random prompt")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling and scoring temperature")
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk size")
    _flags.add_repeats(ap, 2, "runs per mode; the first includes compilation")
    _flags.add_out(ap)
    args = ap.parse_args()

    report = new_report("bench.mismatch")
    rng = np.random.default_rng(0)
    for name in args.models.split(","):
        cfg = rlkjax.ModelConfig.preset(name)
        params = rlkjax.init_params(cfg, seed=0)
        prompts = [
            rng.integers(0, cfg.vocab_size, int(rng.integers(args.min_prompt, args.max_prompt + 1))).tolist()
            for _ in range(args.batch)
        ]
        for numerics in ("fast", "strict"):
            for rep in range(args.repeats):
                r = run(cfg, params, prompts, args.new_tokens, args.temperature, numerics, args.chunk)
                r |= {"model": name, "numerics": numerics, "repeat": rep}
                report["results"].append(r)
                print(json.dumps(r), flush=True)
        del params
    print(
        f"\n{'model':12} {'numerics':8} {'compared':>9} {'bits differ':>11} {'max|d|':>10} {'mean|d|':>10} "
        f"{'k3 KL':>10} {'gen s':>7} {'score s':>7}"
    )
    for r in report["results"]:
        if r["repeat"] == args.repeats - 1:
            print(
                f"{r['model']:12} {r['numerics']:8} {r['tokens_compared']:9d} {r['tokens_bits_differ']:11d} "
                f"{r['max_abs_delta']:10.3g} "
                f"{r['mean_abs_delta']:10.3g} {r['k3_kl']:10.3g} {r['generate_s']:7.2f} {r['score_s']:7.2f}"
            )
    save_report(report, args.out)


if __name__ == "__main__":
    main()
