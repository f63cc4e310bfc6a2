"""Sampler-vs-learner logprob mismatch, strict vs fast, side by side in one run.

For each model shape: sample a batch of prompts x new tokens with `rlkjax.generate`, score the
finished sequences with `rlkjax.score` (the learner's pass), and compare the two logprobs of every
sampled token. Reports tokens compared, tokens whose float32 bits differ, max and mean |delta| and
the k3 estimate of KL(sampler || learner) (mean of r - 1 - log r, r = p_learner / p_sampler),
plus wall times. With --buckets, the same by completion position, with the share of tokens whose ratio
leaves [0.8, 1.2], and --plot draws it (fast beside strict).

    python -m bench.mismatch --models qwen3-0.6b,qwen3-8b --batch 64 --new-tokens 256 --out bench/results/x.json
    python -m bench.mismatch --models qwen3-8b --batch 16 --new-tokens 8192 \
        --buckets 0,512,1024,2048,4096,8192 --score-batch 1 --plot mismatch_by_position.png --out x.json
"""

import json
import time

import numpy as np

import rlkjax
from bench import _flags
from bench._report import new_report, save_report
from rlkjax.core.mismatch import RATIO_BAND, by_position, mismatch_stats


def run(cfg, params, prompts, args, numerics):
    """Sample, score, compare: the overall row, with the by-position rows under "by_position" when asked."""
    t0 = time.perf_counter()
    # no eos id: every completion runs its whole new_tokens (lengths are real)
    sampling = rlkjax.SamplingParams(max_tokens=args.new_tokens, temperature=args.temperature)
    comps = rlkjax.generate(
        params,
        cfg,
        prompts,
        sampling=sampling,
        seeds=list(range(len(prompts))),
        numerics=numerics,
        prefill_chunk_size=args.chunk,
    )
    t1 = time.perf_counter()
    print(
        f"{cfg.num_layers} layers, {numerics}: sampled {sum(len(c.tokens) for c in comps)} tokens in {t1 - t0:.1f} s",
        flush=True,
    )
    # --score-batch rows per call: the fast path's reference ops hold [T, vocab] logits and [T, T] scores per row
    sequences, lens, step = [p + c.tokens for p, c in zip(prompts, comps)], [len(p) for p in prompts], args.score_batch
    scored = []
    for i in range(0, len(sequences), step or len(sequences)):
        part = slice(i, i + (step or len(sequences)))
        scored += rlkjax.score(
            params, cfg, sequences[part], lens[part], temperature=args.temperature, numerics=numerics
        )
    t2 = time.perf_counter()
    sampled = [c.logprobs for c in comps]
    stats = mismatch_stats(np.concatenate(sampled), np.concatenate(scored))
    stats |= {"generate_s": t1 - t0, "score_s": t2 - t1}
    if args.buckets:
        stats["by_position"] = by_position(sampled, scored, args.buckets)
    return stats


def plot(results: list[dict], path: str) -> None:
    """Mean |delta logp| and the share of ratios outside the band, by completion position, one line per model and
    numerics (the last repeat of each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    last = {(r["model"], r["numerics"]): r for r in results if "by_position" in r}
    for (model, numerics), r in sorted(last.items()):
        rows = r["by_position"]
        x = [f"{lo}-{hi}" for lo, hi in (b["positions"] for b in rows)]
        style = dict(marker="o", label=f"{model} {numerics}", linestyle="-" if numerics == "fast" else "--")
        left.plot(x, [b["mean_abs_delta"] for b in rows], **style)
        right.plot(x, [100 * b["ratio_outside_band"] for b in rows], **style)
    left.set(title="sampler vs learner: mean |delta logp| (nats)", xlabel="completion position")
    right.set(title=f"tokens whose ratio leaves [{RATIO_BAND[0]}, {RATIO_BAND[1]}] (%)", xlabel="completion position")
    for ax in (left, right):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = _flags.parser(__doc__)
    _flags.add_models(ap, "qwen3-tiny")
    ap.add_argument("--batch", type=int, default=8, help="prompts per batch")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens sampled per prompt")
    ap.add_argument("--min-prompt", type=int, default=16, help="shortest random prompt")
    ap.add_argument("--max-prompt", type=int, default=128, help="longest random prompt")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling and scoring temperature")
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk size")
    ap.add_argument(
        "--buckets",
        type=lambda v: [int(x) for x in v.split(",")],
        default=None,
        help="completion-position edges, e.g. 0,512,1024,2048: the comparison per bucket",
    )
    ap.add_argument(
        "--score-batch",
        type=int,
        default=0,
        help="rows per scoring call (0: all at once); 1 at long lengths, where fast numerics' reference ops "
        "hold a row's [T, vocab] logits and [T, T] attention scores",
    )
    ap.add_argument("--plot", default=None, help="with --buckets: draw the by-position comparison to this PNG")
    _flags.add_repeats(ap, 2, "runs per mode; the first includes compilation")
    _flags.add_out(ap)
    args = ap.parse_args()
    if args.plot and not args.buckets:
        ap.error("--plot draws the --buckets comparison: give --buckets too")
    if args.buckets and (sorted(args.buckets) != args.buckets or args.buckets[0] < 0):
        ap.error(f"--buckets {args.buckets} must be ascending edges >= 0")

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
                r = run(cfg, params, prompts, args, numerics)
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
    if args.buckets:
        print(
            f"\n{'model':12} {'numerics':8} {'positions':>11} {'compared':>9} {'bits differ':>11} {'mean|d|':>10} "
            f"{'k3 KL':>10} {'ratio out':>9}"
        )
        for r in report["results"]:
            if r["repeat"] == args.repeats - 1:
                for b in r["by_position"]:
                    lo, hi = b["positions"]
                    print(
                        f"{r['model']:12} {r['numerics']:8} {f'{lo}-{hi}':>11} {b['tokens_compared']:9d} "
                        f"{b['tokens_bits_differ']:11d} {b['mean_abs_delta']:10.3g} {b['k3_kl']:10.3g} "
                        f"{100 * b['ratio_outside_band']:8.3g}%"
                    )
    if args.plot:
        plot(report["results"], args.plot)
    save_report(report, args.out)


if __name__ == "__main__":
    main()
