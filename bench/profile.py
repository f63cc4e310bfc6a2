"""Where the time goes: GPU kernel time per kernel name for a decode loop and a learner step.

    python -m bench.profile --model qwen3-8b --batch 1 --context 512 --out /tmp/prof.json
    python -m bench.profile --learner qwen3-1.7b --seq 1024 --tokens 8192

Runs the call once to compile and warm up, then once under `jax.profiler.trace` (CUPTI), reads
the Perfetto trace it writes and sums device-side event durations by name (kernel names: our
Pallas kernels are named `matmul_n{N}_k{K}`, `attention_split`, ...; XLA's are fusion names).
Prints a table sorted by time with the share of the traced device time, per decode step (or per
learner step). Strict and fast side by side when `--sides strict,fast`.
"""

import collections
import glob
import gzip
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import rlkjax
from bench import _flags
from bench._report import new_report, save_report
from bench._timing import F32
from bench.speed_model import decode_loop, learner_batch, random_cache
from rlkjax.core import model, numerics
from rlkjax.core.numerics import PAGE_SIZE
from train.loss import Objective, grpo_loss


def device_events(trace_dir):
    """(name, duration us) of every event on a device track of the Perfetto trace in trace_dir: a GPU's
    (its process is named /device:GPU:N on NVIDIA and AMD), or on the CPU, where there is none, the XLA CPU
    client's threads (a smoke run: op names, not kernels)."""
    path = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not path:
        raise RuntimeError(f"no perfetto trace under {trace_dir}")
    with gzip.open(path[0]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace

    def named(kind, word):
        return {
            (e["pid"], e.get("tid")) if kind == "thread_name" else e["pid"]
            for e in events
            if e.get("ph") == "M" and e.get("name") == kind and word in str(e.get("args", {}).get("name", ""))
        }

    gpu_pids, cpu_threads = named("process_name", "GPU"), named("thread_name", "XLAPjRtCpuClient")
    on_device = (lambda e: e["pid"] in gpu_pids) if gpu_pids else (lambda e: (e["pid"], e.get("tid")) in cpu_threads)
    return [(e["name"], float(e["dur"])) for e in events if e.get("ph") == "X" and on_device(e)]


def profile(fn, per):
    """Kernel time table of one traced call of fn (already warm); durations divided by `per`."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(fn())
        events = device_events(d)
    total = collections.Counter()
    count = collections.Counter()
    for name, dur in events:
        total[name] += dur
        count[name] += 1
    all_us = sum(total.values())
    rows = [{"kernel": n, "us": t / per, "calls": count[n] / per, "share": t / all_us} for n, t in total.most_common()]
    return {"device_us": all_us / per, "kernels": rows}


def decode_profile(name, batch, context, steps, side):
    cfg = rlkjax.ModelConfig.preset(name)
    params = rlkjax.init_params(cfg, seed=0)
    rope = model.rope_tables(cfg)
    pages_per_row = -(-(context + steps) // PAGE_SIZE)
    table = jnp.asarray(1 + np.arange(batch * pages_per_row, dtype=np.int32).reshape(batch, pages_per_row))
    cache = random_cache(cfg, 1 + batch * pages_per_row)
    seeds, temps = jnp.arange(batch, dtype=jnp.uint32), jnp.ones((batch,), F32)
    tokens = jnp.zeros((batch, 1), jnp.int32)
    start = jnp.full((batch,), context - 1, jnp.int32)
    state = {"cache": cache}

    def run():
        _, lp, state["cache"] = decode_loop(
            params, tokens, start, state["cache"], table, seeds, temps, rope, cfg, side, steps
        )
        return lp

    jax.block_until_ready(run())
    return profile(run, steps)


def learner_profile(name, seq, tokens, side):
    cfg = rlkjax.ModelConfig.preset(name)
    b = max(1, tokens // seq)
    master = model.init_params(cfg, seed=0, dtype=F32)
    batch = learner_batch(cfg, b, seq)
    rope = model.rope_tables(cfg)
    ref = jnp.zeros((b, seq - 1), F32)
    fn = jax.jit(jax.value_and_grad(grpo_loss, has_aux=True), static_argnums=5)
    objective = Objective(model.LearnerPass(cfg, side), clip_eps=0.2, beta=0.0)
    run = lambda: fn(master, batch, ref, rope, jnp.float32(b * seq), objective)  # noqa: E731
    jax.block_until_ready(run())
    return profile(run, 1)


def show(title, result, top):
    print(f"\n{title}: {result['device_us']:.1f} us of device time per step")
    for r in result["kernels"][:top]:
        print(f"  {r['us']:10.1f} us  {100 * r['share']:5.1f}%  x{r['calls']:<6.1f} {r['kernel'][:90]}")


def main():
    p = _flags.parser(__doc__)
    _flags.add_model(p, None, "decode: model preset (e.g. qwen3-8b)")
    p.add_argument("--batch", type=int, default=1, help="decode batch")
    p.add_argument("--context", type=int, default=512, help="decode context length")
    p.add_argument("--steps", type=int, default=8, help="decode steps in the traced loop")
    p.add_argument("--learner", default=None, help="learner: model preset (e.g. qwen3-1.7b)")
    p.add_argument("--seq", type=int, default=1024, help="learner sequence length")
    p.add_argument("--tokens", type=int, default=8192, help="learner tokens per step")
    p.add_argument("--sides", default="strict", help="comma-separated: strict,fast")
    p.add_argument("--top", type=int, default=25, help="rows printed per table")
    _flags.add_out(p, "write the tables as JSON here")
    p.add_argument("--dense-backward", action="store_true", help="learner: XLA's dense attention backward, not flash")
    p.add_argument(
        "--copy-backward", action="store_true", help="learner: the matmul backward on transposed copies, not in place"
    )
    args = p.parse_args()
    report = new_report("bench.profile")
    backward = {
        "attention_backward": "dense" if args.dense_backward else "flash",
        "matmul_backward": "copies" if args.copy_backward else "in_place",
    }
    results = {}
    for side in args.sides.split(","):
        if args.model:
            key = f"decode {args.model} b{args.batch} ctx{args.context} {side}"
            results[key] = decode_profile(args.model, args.batch, args.context, args.steps, side)
            show(key, results[key], args.top)
        if args.learner:
            key = f"learner {args.learner} {args.tokens // args.seq}x{args.seq} {side}"
            options = numerics.NumericsOptions(mode=side, **backward)
            results[key] = learner_profile(args.learner, args.seq, args.tokens, options)
            show(key, results[key], args.top)
    report["results"] = [{"what": key, **result} for key, result in results.items()]
    save_report(report, args.out)


if __name__ == "__main__":
    main()
