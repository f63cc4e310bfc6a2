"""Rollouts end to end against the kernel-level decode loop, and the in-process weight sync.

    python -m bench.rollout --models qwen3-0.6b,qwen3-8b --batches 16,64,256 --out bench/results/rollout.json

- engine: `rlkjax.generate` (the engine: admission, chunked prefill, decode rounds of
  `EngineConfig.decode_steps`, host bookkeeping between rounds) at batch B, prompts of `--context`
  tokens, `--new-tokens` N each. A round always runs its D = `decode_steps` steps (a row that is
  done samples nothing), so the decode rate is B x (N - 1 - D) / (t(N) - t(1 + D)) with N - 1 a
  multiple of D: both runs prefill alike and end with a round that samples one token, so what is
  left is (N - 1 - D) / D whole rounds. The kernel-level loop is `decode_round` alone for N - 1 steps on the
  device in one call, same batch, context and cache layout: what the engine could reach with no
  host work at all. Ratio = engine / kernel-level. The strict engine runs twice: calling its step
  functions through jit, and through executables kept on disk (`rlkjax.engine.executable_cache`, as
  `serve.rollout` and `train.grpo` run with a compilation cache set; the key is built in Python at
  every call).
- sync: pushing new weights to an in-process engine: the fp32 -> bf16 cast of the learner's
  master weights plus `Engine.update_weights` (a buffer swap on the same device).
Times are medians of `--repeats` runs after a warm-up run, strict and fast side by side.
"""

import json
import tempfile

import jax
import jax.numpy as jnp

import rlkjax
from bench import _flags
from bench._report import new_report, save_report
from bench._timing import median_time
from rlkjax.core import model
from rlkjax.core.numerics import PAGE_SIZE
from rlkjax.core.shapes import cdiv
from rlkjax.engine import executable_cache
from rlkjax.engine.config import EngineConfig
from rlkjax.engine.engine import Engine
from rlkjax.engine.programs import Decoding, RowSampling, decode_round


def engine_rate(params, cfg, numerics, batch, context, new_tokens, repeats):
    prompts = [[(7 * i + j) % cfg.vocab_size for j in range(context)] for i in range(batch)]

    def run(n):
        return lambda: rlkjax.generate(params, cfg, prompts, max_tokens=n, seeds=list(range(batch)), numerics=numerics)

    d = EngineConfig.decode_steps  # generate's engine (EngineConfig.for_batch) keeps the default
    if (new_tokens - 1) % d or new_tokens < 1 + 2 * d:
        raise ValueError(f"--new-tokens {new_tokens}: 1 + a multiple of decode_steps={d}, at least {1 + 2 * d}")
    full, short = median_time(run(new_tokens), repeats), median_time(run(1 + d), repeats)
    return batch * (new_tokens - 1 - d) / (full - short)


def kernel_rate(params, cfg, numerics, batch, context, new_tokens, repeats):
    steps = new_tokens - 1
    pages_per_row = cdiv(context + steps, PAGE_SIZE)
    table = 1 + jnp.arange(batch * pages_per_row, dtype=jnp.int32).reshape(batch, pages_per_row)
    state = {"cache": model.init_kv_cache(cfg, 1 + batch * pages_per_row)}
    rows = jnp.arange(batch, dtype=jnp.int32)
    # Every input but the cache made once, outside the timing (the RoPE tables alone are eager work).
    args = (
        rows % cfg.vocab_size,
        jnp.full((batch,), context, jnp.int32),
        table,
        RowSampling(
            seeds=rows.astype(jnp.uint32),
            steps=jnp.zeros((batch,), jnp.int32),
            temps=jnp.ones((batch,), jnp.float32),
            budget=jnp.full((batch,), steps, jnp.int32),
            stop_ids=jnp.full((batch, 1), -1, jnp.int32),
            min_tokens=jnp.zeros((batch,), jnp.int32),
        ),
        model.rope_tables(cfg),
    )
    tokens, positions, table, sampling, rope = jax.block_until_ready(args)

    def run():
        cache = state["cache"]
        decoding = Decoding(cfg, numerics, num_steps=steps)
        out, _, state["cache"] = decode_round(params, tokens, positions, cache, table, sampling, rope, decoding)
        out.block_until_ready()

    return batch * steps / median_time(run, repeats)


def sync_time(params, cfg, repeats):
    master = jax.tree.map(lambda w: w.astype(jnp.float32), params)
    engine = Engine(params, cfg, "strict", EngineConfig(num_pages=16, max_batch=1, max_context=64))

    def push():
        policy = jax.tree.map(lambda w: w.astype(cfg.dtype), master)
        jax.block_until_ready(policy)
        engine.update_weights(policy)
        engine.step()  # nothing in flight: the swap happens now

    return median_time(push, repeats)


def settle():
    """One tiny strict generate before anything is timed. The first Pallas call imports part of Pallas lazily,
    and that import registers a JAX config option (`pallas_fuser_disable_nested_fuse`, seen on the CPU with jax
    0.11.2): the tracing context grows, so every function traced before it is traced and compiled again on its
    next call, which would land in the first timed run after a warm-up."""
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    rlkjax.generate(rlkjax.init_params(cfg, seed=0), cfg, [[1, 2, 3]], max_tokens=2, seeds=[0], numerics="strict")


def main():
    ap = _flags.parser(__doc__)
    _flags.add_models(ap, "qwen3-0.6b,qwen3-8b")
    ap.add_argument("--batches", default="16,64,256", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument(
        "--new-tokens", type=int, default=65, help="tokens sampled per sequence (1 + a multiple of decode_steps)"
    )
    _flags.add_repeats(ap, 3, "timed runs (median) after one warm-up")
    ap.add_argument(
        "--sync-models", default="qwen3-0.6b,qwen3-4b,qwen3-8b", help="presets for the weight-sync timing ('' = none)"
    )
    _flags.add_out(ap)
    args = ap.parse_args()
    report = new_report("bench.rollout")
    settle()

    def add(row):  # printed and saved as it comes, so a run cut short keeps what it finished
        report["results"].append(row)
        print(json.dumps(row), flush=True)
        save_report(report, args.out)

    for name in filter(None, args.sync_models.split(",")):  # first: cheap
        cfg = rlkjax.ModelConfig.preset(name)
        add(
            {
                "section": "sync",
                "model": name,
                "in_process_s": sync_time(rlkjax.init_params(cfg, seed=0), cfg, args.repeats),
            }
        )
    for name in args.models.split(","):
        cfg = rlkjax.ModelConfig.preset(name)
        params = rlkjax.init_params(cfg, seed=0)
        for batch in map(int, args.batches.split(",")):
            row = {
                "section": "engine",
                "model": name,
                "batch": batch,
                "context": args.context,
                "new_tokens": args.new_tokens,
            }
            for numerics in ("strict", "fast"):
                row[f"{numerics}_engine_tok_s"] = engine_rate(
                    params, cfg, numerics, batch, args.context, args.new_tokens, args.repeats
                )
                if numerics == "strict":
                    with tempfile.TemporaryDirectory() as directory:
                        executable_cache.use_directory(directory)
                        try:
                            row["strict_engine_from_disk_tok_s"] = engine_rate(
                                params, cfg, numerics, batch, args.context, args.new_tokens, args.repeats
                            )
                        finally:
                            executable_cache.use_directory(None)
                row[f"{numerics}_kernel_tok_s"] = kernel_rate(
                    params, cfg, numerics, batch, args.context, args.new_tokens, args.repeats
                )
                row[f"{numerics}_ratio"] = row[f"{numerics}_engine_tok_s"] / row[f"{numerics}_kernel_tok_s"]
            add(row)
        del params
    print(
        f"\n{'model':11} {'batch':>5} {'engine fast':>12} {'loop fast':>10} {'ratio':>6} "
        f"{'engine strict':>14} {'loop strict':>12} {'ratio':>6} {'from disk':>10}"
    )
    for r in report["results"]:
        if r["section"] == "engine":
            print(
                f"{r['model']:11} {r['batch']:5d} {r['fast_engine_tok_s']:12.0f} {r['fast_kernel_tok_s']:10.0f} "
                f"{r['fast_ratio']:6.2f} "
                f"{r['strict_engine_tok_s']:14.0f} {r['strict_kernel_tok_s']:12.0f} {r['strict_ratio']:6.2f} "
                f"{r['strict_engine_from_disk_tok_s']:10.0f}"
            )
        else:
            print(f"{r['model']:11} weight sync in process: {r['in_process_s'] * 1e3:.1f} ms")
    save_report(report, args.out)


if __name__ == "__main__":
    main()
