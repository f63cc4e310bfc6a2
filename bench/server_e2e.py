"""End-to-end rollout server run: start `serve.rollout`, fire many concurrent requests with mixed
prompt lengths, then score every completion in this process (the learner's pass, same weights)
and count the tokens whose logprob bits differ (strict must be 0).

    python -m bench.server_e2e --model qwen3-0.6b --requests 256 --out bench/results/server.json
"""

import argparse
import concurrent.futures
import json
import os
import time

import numpy as np


def fire(client, args):
    """All requests at once (mixed prompt lengths, n 1 or 4); returns results, wall time, metrics, jobs."""
    import rlkjax

    cfg = rlkjax.ModelConfig.preset(args.model)
    rng = np.random.default_rng(0)
    jobs = [
        dict(
            prompt=rng.integers(0, cfg.vocab_size, int(rng.integers(1, args.max_prompt + 1))).tolist(),
            n=int(rng.choice([1, 4])),
            seed=i,
        )
        for i in range(args.requests)
    ]
    client.generate([[1, 2, 3]], max_new_tokens=2)  # first compile out of the timing
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.requests) as pool:
        results = list(
            pool.map(
                lambda j: client.generate([j["prompt"]], n=j["n"], max_new_tokens=args.max_new_tokens, seed=j["seed"])[
                    0
                ],
                jobs,
            )
        )
    wall = time.perf_counter() - t
    metrics = client.metrics()
    print(f"{len(jobs)} requests answered in {wall:.1f} s; stopping the server", flush=True)
    return results, wall, metrics, jobs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-tiny", help="preset served (random weights, seed 0)")
    ap.add_argument("--numerics", default="strict", choices=["strict", "fast"], help="server numerics")
    ap.add_argument("--requests", type=int, default=64, help="concurrent requests")
    ap.add_argument("--max-prompt", type=int, default=512, help="longest prompt (shortest is 1)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens per sample")
    ap.add_argument("--max-batch", type=int, default=256, help="the server's --max-batch")
    ap.add_argument("--port", type=int, default=8765, help="loopback port")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.45"  # this process scores on the server's GPU
    import rlkjax
    from bench._report import new_report, save_report
    from bench._server import running_server
    from rlkjax.client import RolloutClient
    from rlkjax.mismatch import mismatch_stats

    server_args = [
        "--model", args.model, "--numerics", args.numerics,
        "--max-batch", str(args.max_batch), "--num-pages", "16384", "--max-context", "1024",
    ]  # fmt: skip
    with running_server(server_args, args.port) as url:
        client = RolloutClient(url, timeout=3600)
        results, wall, metrics, jobs = fire(client, args)
    print("server stopped; scoring every completion", flush=True)
    cfg = rlkjax.ModelConfig.preset(args.model)
    params = rlkjax.init_params(cfg, seed=0)
    seqs, plens, sampled = [], [], []
    for job, samples in zip(jobs, results):
        for s in samples:
            seqs.append(job["prompt"] + s["tokens"])
            plens.append(len(job["prompt"]))
            sampled.append(s["logprobs"])
    scored = []
    for i in range(0, len(seqs), 32):
        scored += rlkjax.score(params, cfg, seqs[i : i + 32], plens[i : i + 32], numerics=args.numerics)
    stats = mismatch_stats(np.concatenate(sampled), np.concatenate(scored))
    report = (
        new_report("bench.server_e2e")
        | stats
        | {
            "requests": args.requests,
            "completions": len(seqs),
            "wall_s": wall,
            "tokens_per_s": stats["tokens_compared"] / wall,
            "server_metrics": [line for line in metrics.splitlines() if line.startswith("rlkjax_")],
        }
    )
    print(json.dumps(report, indent=2))
    save_report(report, args.out)


if __name__ == "__main__":
    main()
