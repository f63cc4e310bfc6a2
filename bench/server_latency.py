"""Time to first token and inter-token latency of the real server, streaming, at several concurrencies.

    python -m bench.server_latency --model qwen3-0.6b --concurrency 1,16,256 --out bench/results/latency.json

Starts `python -m serve.rollout` on loopback, then for each concurrency C sends C streaming
`/v1/completions` requests at once (token-id prompts of `--prompt` tokens, up to `--max-tokens` new
tokens each) and records, per request, when each server-sent
chunk arrives and how many tokens it carries (`return_token_ids`). Reports p50/p99 of
- TTFT: request sent -> first chunk with a token;
- ITL per token: the gap between a request's consecutive token chunks / the chunk's tokens (the
  engine sends a round of `--decode-steps` tokens at once, so the chunk gap is also reported);
- output tokens/s over the concurrency level's wall time.
"""

import asyncio
import json
import os
import shlex
import time

import aiohttp
import numpy as np

from bench import _flags
from bench._report import new_report, save_report
from bench._server import running_server


async def one_request(session, url, prompt, max_tokens, seed):
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "seed": seed,
        "stream": True,
        "return_token_ids": True,
    }
    sent = time.perf_counter()
    arrivals = []  # (time, tokens in the chunk)
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            n = sum(len(c.get("token_ids", [])) for c in chunk["choices"])
            if n:
                arrivals.append((time.perf_counter(), n))
    return sent, arrivals


async def level(url, concurrency, prompt_len, max_tokens, vocab, seed0):
    rng = np.random.default_rng(seed0)
    prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(concurrency)]
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        runs = await asyncio.gather(
            *(one_request(session, url, p, max_tokens, seed0 + i) for i, p in enumerate(prompts))
        )
        wall = time.perf_counter() - start
    ttft, itl, gaps, tokens = [], [], [], 0
    for sent, arrivals in runs:
        ttft.append(arrivals[0][0] - sent)
        tokens += sum(n for _, n in arrivals)
        for (t0, _), (t1, n) in zip(arrivals, arrivals[1:]):
            gaps.append(t1 - t0)
            itl.append((t1 - t0) / n)

    def pct(xs):
        if not xs:  # every request's tokens came in one chunk
            return None
        return {"p50_ms": 1e3 * float(np.percentile(xs, 50)), "p99_ms": 1e3 * float(np.percentile(xs, 99))}

    return {
        "concurrency": concurrency,
        "prompt_tokens": prompt_len,
        "max_tokens": max_tokens,
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "ttft": pct(ttft),
        "itl_per_token": pct(itl),
        "chunk_gap": pct(gaps),
    }


def main():
    ap = _flags.parser(__doc__)
    _flags.add_model(ap, "qwen3-tiny", "preset served (random weights, seed 0)")
    _flags.add_numerics(ap, "strict", "server numerics")
    ap.add_argument("--concurrency", default="1,16,256", help="comma-separated concurrent request counts")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument("--decode-steps", type=int, default=8, help="the server's decode steps per round")
    ap.add_argument("--max-batch", type=int, default=256, help="the server's --max-batch")
    ap.add_argument("--num-pages", type=int, default=8192, help="the server's --num-pages")
    ap.add_argument("--max-context", type=int, default=2048, help="the server's --max-context")
    ap.add_argument(
        "--token-budget", type=int, default=None, help="the server's prompt tokens prefilled a step (default: its own)"
    )
    ap.add_argument(
        "--server-flags",
        default="",
        help="more flags for serve.rollout, as one string (e.g. --server-flags='--no-warmup')",
    )
    ap.add_argument("--port", type=int, default=8766, help="loopback port")
    _flags.add_out(ap)
    args = ap.parse_args()
    # This process only sends requests, but new_report's jax.devices() starts a GPU client, which would take
    # JAX's default 75% of the GPU the server (45%) needs.
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.05"
    import rlkjax

    vocab = rlkjax.ModelConfig.preset(args.model).vocab_size
    server_args = [
        "--model", args.model, "--numerics", args.numerics, "--max-batch", str(args.max_batch),
        "--num-pages", str(args.num_pages), "--max-context", str(args.max_context),
        "--decode-steps", str(args.decode_steps),
    ] + (["--token-budget", str(args.token_budget)] if args.token_budget else [])  # fmt: skip
    server_args += shlex.split(args.server_flags)
    report = new_report("bench.server_latency") | {
        "model": args.model, "numerics": args.numerics, "server_args": server_args, "levels": []
    }  # fmt: skip
    with running_server(server_args, args.port) as url:
        for c in (int(c) for c in args.concurrency.split(",")):
            # The same shapes once, short, so compilation stays out of the timed run.
            asyncio.run(level(url, c, args.prompt, 2 * args.decode_steps, vocab, 7))
            row = asyncio.run(level(url, c, args.prompt, args.max_tokens, vocab, 1000 * c))
            print(json.dumps(row), flush=True)
            report["levels"].append(row)
            save_report(report, args.out)  # after each level, so a run cut short keeps what it measured
    save_report(report, args.out)


if __name__ == "__main__":
    main()
