"""Decode throughput, strict vs fast side by side, on the GPU.

For each model shape and batch size: prefill `--context` random tokens per row, then time
`--steps` decode steps (forward + fused sample) run inside ONE jitted `fori_loop`, so the number
is GPU time, not Python dispatch. Reports tokens/s, time per output token, and the fraction of the
memory-bandwidth ceiling: bytes a decode step must read (weights once + each row's KV cache) over
the device-to-device copy bandwidth measured in the same run.

    python -m bench.decode --models qwen3-0.6b,qwen3-8b --batches 1,16,64,256 --out bench/results/decode.json
"""
import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import rlkjax
from bench._report import new_report, save_report
from rlkjax import model
from rlkjax.numerics import PAGE_SIZE
from rlkjax.engine import prefill_chunk


@functools.partial(jax.jit, static_argnames=("cfg", "numerics", "steps"), donate_argnames=("cache",))
def decode_loop(params, tokens, start, cache, page_table, seeds, temps, rope, cfg, numerics, steps):
    """`steps` decode steps feeding each sampled token back in; the same forward + sample as the engine."""
    def body(i, carry):
        tok, cache, _ = carry
        pos = (start + i)[:, None]
        hidden, cache = model.forward(params, tok, pos, cache, page_table, rope, cfg, numerics)
        nxt, lp = model.sample(params, hidden[:, 0], seeds, jnp.full_like(seeds, i, jnp.int32), temps, numerics)
        return nxt[:, None], cache, lp
    tok, cache, lp = jax.lax.fori_loop(0, steps, body, (tokens, cache, jnp.zeros(tokens.shape[0], jnp.float32)))
    return tok, lp, cache


def copy_bandwidth() -> float:
    x = jnp.ones((2**30,), jnp.float32)  # 4 GiB
    f = jax.jit(lambda x: x + 0)  # read + write
    f(x).block_until_ready()
    t = time.perf_counter()
    for _ in range(10):
        y = f(x)
    y.block_until_ready()
    return 2 * x.nbytes * 10 / (time.perf_counter() - t)


def bench(cfg, params, batch, context, steps, numerics):
    pages_per_row = -(-(context + steps) // PAGE_SIZE)
    page_table = jnp.asarray(1 + np.arange(batch * pages_per_row, dtype=np.int32).reshape(batch, pages_per_row))
    cache = model.init_kv_cache(cfg, 1 + batch * pages_per_row)
    rope = model.rope_tables(cfg)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (batch, context)).astype(np.int32)
    chunk = 256
    for s in range(0, context - 1, chunk):
        pos = np.arange(s, s + chunk)[None].repeat(batch, 0)
        pos = np.where(pos < context - 1, pos, -1).astype(np.int32)
        tok = np.pad(tokens[:, s : s + chunk], ((0, 0), (0, chunk - tokens[:, s : s + chunk].shape[1])))
        cache = prefill_chunk(params, tok, pos, cache, page_table, rope, cfg, numerics)
    args = (jnp.asarray(tokens[:, -1:]), jnp.full((batch,), context - 1, jnp.int32))
    seeds, temps = jnp.arange(batch, dtype=jnp.uint32), jnp.ones((batch,), jnp.float32)
    _, lp, cache = decode_loop(params, *args, cache, page_table, seeds, temps, rope, cfg, numerics, steps)  # compile + warm
    lp.block_until_ready()
    # The second run re-writes the same positions: identical work, now timed.
    t = time.perf_counter()
    _, lp, cache = decode_loop(params, *args, cache, page_table, seeds, temps, rope, cfg, numerics, steps)
    lp.block_until_ready()
    dt = time.perf_counter() - t
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params)) - (0 if cfg.tie_embeddings else params["embed_tokens"].nbytes)
    kv_bytes = batch * (context + steps / 2) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    return {"tokens_per_s": batch * steps / dt, "ms_per_step": 1e3 * dt / steps, "bytes_per_step": weight_bytes + kv_bytes}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-8b", help="comma-separated presets (random weights)")
    ap.add_argument("--batches", default="1,16,64,256", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=512, help="tokens already in the cache per row")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    bw = copy_bandwidth()
    report = new_report("bench.decode") | {"copy_bandwidth_GBps": bw / 1e9}
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    for name in args.models.split(","):
        cfg = rlkjax.ModelConfig.preset(name)
        params = rlkjax.init_params(cfg, seed=0)
        for batch in map(int, args.batches.split(",")):
            row = {"model": name, "batch": batch}
            for numerics in ("fast", "strict"):
                r = bench(cfg, params, batch, args.context, args.steps, numerics)
                row |= {f"{numerics}_{k}": v for k, v in r.items()}
                row[f"{numerics}_hbm_fraction"] = r["bytes_per_step"] / (r["ms_per_step"] / 1e3) / bw
            row["strict_over_fast_time"] = row["strict_ms_per_step"] / row["fast_ms_per_step"]
            report["results"].append(row)
            print(json.dumps(row), flush=True)
        del params
    print(f"\n{'model':11} {'batch':>5} {'fast tok/s':>10} {'strict tok/s':>12} {'fast ms':>8} {'strict ms':>9} {'strict/fast':>11} {'strict HBM%':>11}")
    for r in report["results"]:
        print(f"{r['model']:11} {r['batch']:5d} {r['fast_tokens_per_s']:10.0f} {r['strict_tokens_per_s']:12.0f} {r['fast_ms_per_step']:8.2f} "
              f"{r['strict_ms_per_step']:9.2f} {r['strict_over_fast_time']:11.2f} {100 * r['strict_hbm_fraction']:10.1f}%")
    save_report(report, args.out)


if __name__ == "__main__":
    main()
