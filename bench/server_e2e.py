"""End-to-end rollout server run: start `serve.rollout`, fire many concurrent requests with mixed
prompt lengths, then score every completion in this process (the learner's pass, same weights)
and count the tokens whose logprob bits differ (strict must be 0).

    python -m bench.server_e2e --model qwen3-0.6b --requests 256 --min-new-tokens 128 --max-new-tokens 512 \
        --kernel-ref --update-weights --out bench/results/server.json

- Each request: a prompt of 1..--max-prompt random tokens, n = 1 or 4, --min-new-tokens..--max-new-tokens new
  tokens (drawn per request), all sent at once. tokens_per_s = output tokens / wall time of the whole burst,
  after a warm-up burst of the same requests with an eighth of the new tokens (it compiles the shapes).
- --kernel-ref: after the server stops, `decode_round` alone, one jitted call, at batch --max-batch, context =
  the mean prompt length, for the mean number of new tokens (bench.rollout's kernel-level loop): what the
  server's decoding could reach with no host, HTTP or prefill work; kernel_ratio = server / kernel-level.
- --update-weights: while the server still runs, save other weights (seed 1) as an HF checkpoint, time
  POST /update_weights (load + swap), then check one completion reports the new policy version and its
  logprobs are the new weights' bits (scored here).
"""

import concurrent.futures
import json
import os
import shlex
import tempfile
import time

import numpy as np

from bench import _flags

ADMIN_KEY = "bench-server-e2e"  # loopback only; the server gets it through RLKJAX_ADMIN_KEY, not argv


def make_jobs(args, vocab_size):
    """The requests: mixed prompt lengths (1..max_prompt), n 1 or 4, new tokens drawn per request."""
    rng = np.random.default_rng(0)
    low = args.min_new_tokens or args.max_new_tokens
    return [
        dict(
            prompt=rng.integers(0, vocab_size, int(rng.integers(1, args.max_prompt + 1))).tolist(),
            n=int(rng.choice([1, 4])),
            max_new_tokens=int(rng.integers(low, args.max_new_tokens + 1)),
            seed=i,
        )
        for i in range(args.requests)
    ]


def fire(client, jobs):
    """All requests at once; returns the results and the wall time."""
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(
            pool.map(
                lambda j: client.generate([j["prompt"]], n=j["n"], max_tokens=j["max_new_tokens"], seed=j["seed"])[0],
                jobs,
            )
        )
    wall = time.perf_counter() - t
    print(f"{len(jobs)} requests answered in {wall:.1f} s", flush=True)
    return results, wall


def warm_up(client, jobs, decode_steps):
    """The same burst with an eighth of the new tokens (at least two decode rounds; other seeds): sequences
    still finish at staggered times, so the server compiles its programs for the prefill and batch shapes
    the timed burst meets and compilation stays out of the timing (`compilations_in_timed_burst` says whether
    it did)."""
    short = [
        j | {"max_new_tokens": min(j["max_new_tokens"], max(2 * decode_steps, j["max_new_tokens"] // 8))} for j in jobs
    ]
    return fire(client, [j | {"seed": 10**6 + j["seed"]} for j in short])[1]


def server_metrics(client) -> dict[str, float]:
    """The server's rlkjax_* gauges (its /metrics), by name."""
    rows = [x.split() for x in client.metrics().splitlines() if x.startswith("rlkjax_")]
    return {name: float(value) for name, value in rows}


# Where the timed burst's wall time went, from the server's counters read before and after it.
BURST_COUNTERS = {
    "steps": "rlkjax_engine_steps_total",
    "engine_step_s": "rlkjax_engine_step_seconds_total",
    "engine_wait_s": "rlkjax_engine_wait_seconds_total",
    "engine_gap_s": "rlkjax_engine_gap_seconds_total",
    "engine_dispatch_s": "rlkjax_engine_dispatch_seconds_total",
    "prefill_tokens": "rlkjax_prefill_tokens_total",
    "compilations": "rlkjax_compiled_shapes",
}


def swap_weights(client, cfg, numerics):
    """Time pushing new weights (seed 1) to the server over /update_weights; returns the timings, the new
    policy version, and one completion sampled after the swap with its logprobs scored under the new weights."""
    import rlkjax

    new_params = rlkjax.init_params(cfg, seed=1)
    with tempfile.TemporaryDirectory(prefix="server_e2e_weights_") as path:
        t = time.perf_counter()
        rlkjax.save_hf_checkpoint(path, cfg, new_params)
        save_s = time.perf_counter() - t
        t = time.perf_counter()
        version = client.update_weights(path)
        update_s = time.perf_counter() - t
    prompt = list(range(1, 17))
    sample = client.generate([prompt], max_tokens=16, seed=5)[0][0]
    scored = rlkjax.score(new_params, cfg, [prompt + sample["tokens"]], [len(prompt)], numerics=numerics)[0]
    same_bits = np.array_equal(np.asarray(sample["logprobs"], np.float32).view("uint32"), scored.view("uint32"))
    return {
        "checkpoint_save_s": save_s,
        "update_weights_s": update_s,
        "policy_version": version,
        "completion_policy_version": sample["policy_version"],
        "completion_bits_equal_new_weights": bool(same_bits),
    }


def parse_args(argv=None):
    ap = _flags.parser(__doc__)
    _flags.add_model(ap, "qwen3-tiny", "preset served (random weights, seed 0)")
    _flags.add_numerics(ap, "strict", "server numerics")
    ap.add_argument("--requests", type=int, default=64, help="concurrent requests")
    ap.add_argument("--max-prompt", type=int, default=512, help="longest prompt (shortest is 1)")
    ap.add_argument("--min-new-tokens", type=int, default=None, help="fewest tokens per sample (default: the most)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="most tokens per sample")
    ap.add_argument("--max-batch", type=int, default=256, help="the server's --max-batch")
    ap.add_argument("--decode-steps", type=int, default=8, help="the server's decode steps per round")
    ap.add_argument(
        "--num-pages", type=int, default=16384, help="the server's KV pages (fewer: room for a large model's swap)"
    )
    ap.add_argument(
        "--token-budget", type=int, default=None, help="the server's prompt tokens prefilled a step (default: its own)"
    )
    ap.add_argument("--kernel-ref", action="store_true", help="also time the kernel-level decode loop (see above)")
    ap.add_argument("--update-weights", action="store_true", help="also time POST /update_weights (see above)")
    ap.add_argument(
        "--server-flags",
        default="",
        help="more flags for serve.rollout, as one string (e.g. --server-flags='--no-warmup')",
    )
    ap.add_argument("--port", type=int, default=8765, help="loopback port")
    _flags.add_out(ap)
    return ap.parse_args(argv)


def serve_and_fire(args, cfg, jobs):
    """Start the server, warm it up, time the burst (and the weight swap), stop it. Returns the
    report's timing part and each job's samples."""
    from bench._report import new_report
    from bench._server import running_server
    from rlkjax.client import RolloutClient

    server_args = [
        "--model", args.model, "--numerics", args.numerics, "--max-batch", str(args.max_batch),
        "--num-pages", str(args.num_pages), "--max-context", str(args.max_prompt + args.max_new_tokens),
        "--decode-steps", str(args.decode_steps),
    ] + (["--token-budget", str(args.token_budget)] if args.token_budget else [])  # fmt: skip
    server_args += shlex.split(args.server_flags)
    swap = None
    with running_server(server_args, args.port) as url:
        client = RolloutClient(url, admin_key=ADMIN_KEY, timeout=3600)
        warmup_s = warm_up(client, jobs, args.decode_steps)
        before = server_metrics(client)
        results, wall = fire(client, jobs)
        after = server_metrics(client)
        burst = {key: after[name] - before[name] for key, name in BURST_COUNTERS.items()}
        # Host work inside the engine's steps (scheduling, reading rounds); the rest of the wall time
        # the engine thread sat outside step() (idle, or waiting for the GIL / the step lock).
        burst["engine_host_s"] = burst["engine_step_s"] - burst["engine_wait_s"]
        burst["outside_steps_s"] = wall - burst["engine_step_s"]
        if args.update_weights:
            swap = swap_weights(client, cfg, args.numerics)
            print(json.dumps(swap), flush=True)
        print("stopping the server", flush=True)
    output_tokens = sum(len(s["tokens"]) for samples in results for s in samples)
    report = new_report("bench.server_e2e") | {
        "requests": args.requests,
        "server_args": server_args,
        "completions": sum(len(samples) for samples in results),
        "output_tokens": output_tokens,
        "warmup_s": warmup_s,
        "wall_s": wall,
        "compilations_in_timed_burst": int(burst.pop("compilations")),
        "tokens_per_s": output_tokens / wall,
        "timed_burst": burst,
        "server_metrics": after,
    }
    if swap:
        report["update_weights"] = swap
    return report, results


def main():
    args = parse_args()
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.45"  # this process scores on the server's GPU
    os.environ["RLKJAX_ADMIN_KEY"] = ADMIN_KEY  # inherited by the server
    import rlkjax
    from bench._report import save_report
    from rlkjax.core.mismatch import mismatch_stats

    cfg = rlkjax.ModelConfig.preset(args.model)
    jobs = make_jobs(args, cfg.vocab_size)
    report, results = serve_and_fire(args, cfg, jobs)
    save_report(report, args.out)  # saved at each stage, so a run cut short keeps what it measured
    print(f"server stopped; {report['tokens_per_s']:.0f} output tokens/s; scoring every completion", flush=True)
    seqs = [job["prompt"] + s["tokens"] for job, samples in zip(jobs, results) for s in samples]
    plens = [len(job["prompt"]) for job, samples in zip(jobs, results) for _ in samples]
    sampled = [s["logprobs"] for samples in results for s in samples]
    params = rlkjax.init_params(cfg, seed=0)
    scored = []
    for i in range(0, len(seqs), 32):
        scored += rlkjax.score(params, cfg, seqs[i : i + 32], plens[i : i + 32], numerics=args.numerics)
    report |= mismatch_stats(np.concatenate(sampled), np.concatenate(scored))
    save_report(report, args.out)
    print(f"{report['tokens_bits_differ']} of {report['tokens_compared']} tokens' logprob bits differ", flush=True)
    if args.kernel_ref:
        from bench.rollout import kernel_rate

        context = round(float(np.mean(plens)))
        new_tokens = round(report["output_tokens"] / len(seqs))
        rate = kernel_rate(params, cfg, args.numerics, args.max_batch, context, new_tokens, repeats=2)
        report |= {
            "kernel_ref": {"batch": args.max_batch, "context": context, "new_tokens": new_tokens, "tok_s": rate},
            "kernel_ratio": report["tokens_per_s"] / rate,
        }
    print(json.dumps(report, indent=2))
    save_report(report, args.out)


if __name__ == "__main__":
    main()
