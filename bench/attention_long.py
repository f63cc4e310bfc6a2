"""Attention alone at the learner's lengths, ours beside cuDNN's flash attention (the kernel PyTorch's SDPA runs on
Hopper, here through `jax.nn.dot_product_attention(implementation="cudnn")`), at Qwen3-4B/8B heads (32 query,
8 KV heads of 128):

    python -m bench.attention_long --out attention_long.json [--before OLD/pallas_kernels/attention.py]

- forward: causal attention of B x T tokens over their own keys (the learner's pass, a long prefill chunk),
  B x T from 8 x 1024 to 1 x 32768: the shipped tile table, then the table whose row sums are products
  (numerics.ATTENTION_LONG_ROWS) at each launch (`--launches`: query rows per tile, warps, stages, tiles per
  program) with its output compared bit for bit with that table's 16-row decode tiles (a launch that changes
  a bit may not be adopted), and cuDNN's;
- forward and backward: our forward with each flash-backward tile (`--backward`: block_q, block_k, warps,
  stages, and the dq kernel's block_q, block_k, 0 for dkdv's; gradients are the same bits run to run, not
  across tiles) against cuDNN's forward and backward;
- decode: one token per row over 8k and 32k keys at batch 1 and 16, in a loop of 36 calls on the device.

--before times another version of pallas_kernels/attention.py (a file; the rest of pallas_kernels is this
tree's) at its shipped launch beside ours in every section, so a change is measured against what it replaced in
one run. FLOPs: 4 x Hq x Dh per visible (query, key) pair (bench.speed_kernels.causal_flops), the backward 2.5x
the forward's (its five products to the forward's two); the shares are of `jnp.dot`'s bf16 rate measured in
the same run.
"""

import dataclasses
import functools
import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np

from bench import _flags, _report
from bench._timing import ceilings, loop_time, median_time, rand
from bench.speed_kernels import causal_flops
from pallas_kernels import attention
from pallas_kernels.attention_bwd import AttentionBwdConfig
from pallas_kernels.common import interpret_mode
from rlkjax.core import numerics
from rlkjax.core.numerics import PAGE_SIZE

HEADS = (32, 8, 128)  # Qwen3-4B and 8B: query heads, KV heads, head dim
SHAPES = "8x1024,1x8192,1x16384,1x32768"
# (long_rows, long_warps, num_stages, tiles): the shipped launch first
LAUNCHES = "64:4:2:1,128:4:2:1,128:8:2:1,64:4:3:1,64:8:2:1"
BACKWARD = "64:64:4:2:0:0,128:64:8:2:0:0,32:128:4:3:128:32,64:128:8:2:128:64,128:128:8:2:0:0"
# What --before runs: the attention launch shipped before long query tiles (16-row tiles, two per program).
BEFORE_LAUNCH = dict(page_size=16, block_rows=16, kv_split=256, num_warps=2, num_stages=2, block_pages=4, tiles=2)


def load_before(path):
    """Another version of pallas_kernels/attention.py as a module, and its shipped config (None: no --before)."""
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("attention_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, module.AttentionConfig(**BEFORE_LAUNCH, backward=numerics.ATTENTION.backward)


def case(b, t, heads=HEADS, ctx=None):
    """q [b, t, Hq, Dh] at positions ctx-t .. ctx-1 (ctx: t), the cache holding every row's keys in its own pages,
    those keys and values as contiguous [b, ctx, Hkv, Dh] (for cuDNN), the page table and the positions."""
    hq, hkv, dh = heads
    ctx = ctx or t
    ppr = -(-ctx // PAGE_SIZE)
    k, v = rand(2, (b, ppr * PAGE_SIZE, hkv, dh)), rand(3, (b, ppr * PAGE_SIZE, hkv, dh))

    def paged(x):  # [b, ppr*16, hkv, dh] -> [1, hkv, 1 + b*ppr, 16, dh], page 0 the trash page
        x = x.reshape(b * ppr, PAGE_SIZE, hkv, dh).transpose(2, 0, 1, 3)[None]
        return jnp.pad(x, ((0, 0), (0, 0), (1, 0), (0, 0), (0, 0)))

    pt = jnp.asarray(1 + np.arange(b * ppr, dtype=np.int32).reshape(b, ppr))
    pos = jnp.broadcast_to(jnp.arange(ctx - t, ctx, dtype=jnp.int32), (b, t))
    return rand(1, (b, t, hq, dh)), (paged(k), paged(v)), (k[:, :ctx], v[:, :ctx]), pt, pos


def ours(module, config, q, pages, pt, pos):
    """The strict forward over the filled cache (no KV write), (out, lse); plan made inside, as the model does."""
    plan = module.plan(pt, pos, q.shape[2] // pages[0].shape[1], PAGE_SIZE, config)
    return module.padded_attention(q, *pages, jnp.int32(0), plan, config, interpret_mode())


def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def parse(spec, n):
    rows = [tuple(int(x) for x in item.split(":")) for item in spec.split(",") if item]
    if any(len(r) != n for r in rows):
        raise SystemExit(f"each of {spec!r} needs {n} numbers joined by ':'")
    return rows


def measure(what, fn, flops, rate, repeats) -> dict:
    """A row for what = (section, shape, name, config): fn()'s median time, TFLOP/s and share of `jnp.dot`'s rate,
    or the error (a launch Triton cannot compile is a result too)."""
    section, shape, name, config = what
    row = {"section": section, "shape": shape, "name": name, "config": config}
    try:
        dt = median_time(lambda: jax.block_until_ready(fn()), repeats)
    except Exception as e:  # noqa: BLE001
        return row | {"error": str(e)[:300]}
    return row | {"us": 1e6 * dt, "tflops": flops / dt / 1e12, "dot_fraction": flops / dt / rate}


def forward_rows(shapes, launches, before, rate, repeats, add, heads=HEADS):
    for b, t in shapes:
        q, pages, (k, v), pt, pos = case(b, t, heads)
        flops, shape = causal_flops(pos, heads[0], heads[2]), f"B={b} T={t}"

        def row(name, config, f, ref=None):
            r = measure(("forward", shape, name, config), f, flops, rate, repeats)
            if "error" in r:
                return add(r)
            out = np.asarray(f()).view(np.uint16)
            add(r | {"same_bits_as_decode_tiles": None if ref is None else bool(np.array_equal(out, ref))})
            return out

        shipped = jax.jit(lambda q, pages, pt, pos: ours(attention, numerics.ATTENTION, q, pages, pt, pos)[0])
        row("ours, shipped table", [16, 2, 2, 2], lambda: shipped(q, pages, pt, pos))
        products = numerics.ATTENTION_LONG_ROWS
        decode_tiles = dataclasses.replace(products, long_rows=0, long_warps=0, tiles=1)
        f = jax.jit(lambda q, pages, pt, pos: ours(attention, decode_tiles, q, pages, pt, pos)[0])
        ref = row("products, decode's 16-row tiles", [16, 2, 2, 1], lambda: f(q, pages, pt, pos))
        for rows, warps, stages, tiles in launches:
            c = dataclasses.replace(products, long_rows=rows, long_warps=warps, num_stages=stages, tiles=tiles)
            g = jax.jit(functools.partial(lambda q, pages, pt, pos, c: ours(attention, c, q, pages, pt, pos)[0], c=c))
            row("products", [rows, warps, stages, tiles], lambda g=g: g(q, pages, pt, pos), ref)
        if before:
            h = jax.jit(lambda q, pages, pt, pos: ours(*before, q, pages, pt, pos)[0])
            row("before", [16, 2, 2, 2], lambda: h(q, pages, pt, pos))
        c = jax.jit(cudnn)
        row("cudnn", None, lambda: c(q, k, v))


def backward_rows(shapes, tiles, before, rate, repeats, add, heads=HEADS):
    """Forward and backward of sum(out * do) over q, k, v (our KV write included: the learner's call)."""
    for b, t in shapes:
        q, pages, (k, v), pt, pos = case(b, t, heads)
        do = rand(4, q.shape)
        flops, shape = 3.5 * causal_flops(pos, heads[0], heads[2]), f"B={b} T={t}"
        empty = tuple(jnp.zeros_like(p) for p in pages)

        def timed(name, config, grad):
            f = jax.jit(grad)
            add(measure(("forward_backward", shape, name, config), lambda: f(q, k, v, do), flops, rate, repeats))

        def ours_grad(module, config):
            def loss(q, k, v, do):
                plan = module.plan(pt, pos, q.shape[2] // k.shape[2], PAGE_SIZE, config)
                out = module.paged_attention(q, k, v, empty, jnp.int32(0), plan, config, interpret_mode())[0]
                return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))

            return jax.grad(loss, (0, 1, 2))

        for bq, bk, warps, stages, dq_bq, dq_bk in tiles:
            bwd = AttentionBwdConfig(bq, bk, warps, stages, dq_block_q=dq_bq, dq_block_k=dq_bk)
            timed(
                "ours",
                [bq, bk, warps, stages, dq_bq, dq_bk],
                ours_grad(attention, dataclasses.replace(numerics.ATTENTION, backward=bwd)),
            )
        if before:
            module, config = before
            timed("before", list(dataclasses.astuple(config.backward))[:4], ours_grad(module, config))
        cudnn_loss = lambda q, k, v, do: jnp.sum(cudnn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))  # noqa: E731
        timed("cudnn", None, jax.grad(cudnn_loss, (0, 1, 2)))


def decode_rows(shapes, before, bw, repeats, add, heads=HEADS, iters=36):
    """One token per row over ctx keys, `iters` calls in a loop (each output the next query)."""
    for b, ctx in shapes:
        q, pages, _, pt, pos = case(b, 1, heads, ctx=ctx)
        kv_bytes = 2 * b * ctx * heads[1] * heads[2] * 2
        for name, (module, config) in [("ours", (attention, numerics.ATTENTION))] + (
            [("before", before)] if before else []
        ):
            plan = module.plan(pt, pos, heads[0] // heads[1], PAGE_SIZE, config)

            def step(i, q, consts, module=module, config=config):
                pages, plan = consts
                return module.padded_attention(q, *pages, jnp.int32(0), plan, config, interpret_mode())[0]

            dt, _ = loop_time(step, q, (pages, plan), iters, repeats)
            add(
                {
                    "section": "decode",
                    "shape": f"B={b} ctx={ctx}",
                    "name": name,
                    "us": 1e6 * dt,
                    "kv_bytes_fraction": kv_bytes / dt / bw,
                }
            )


def markdown(rows) -> str:
    """Per section and shape: each row's time, TFLOP/s (or share of the copy bandwidth) and ratio to cuDNN's."""
    lines = []
    for section in ("forward", "forward_backward", "decode"):
        sel = [r for r in rows if r["section"] == section]
        if not sel:
            continue
        lines += [
            f"\n{section}:\n",
            "| shape | name | config | us | TFLOP/s or KV share | cuDNN / this | bits |",
            "|---|---|---|---:|---:|---:|---|",
        ]
        for r in sel:
            peer = next((p for p in sel if p["shape"] == r["shape"] and p["name"] == "cudnn" and "us" in p), None)
            if "error" in r:
                lines.append(f"| {r['shape']} | {r['name']} | {r.get('config')} | error | {r['error'][:60]} | | |")
                continue
            speed = f"{r['tflops']:.0f}" if "tflops" in r else f"{r['kv_bytes_fraction']:.0%}"
            ratio = f"{peer['us'] / r['us']:.2f}" if peer else "-"
            bits = {None: "", True: "same", False: "DIFFER"}[r.get("same_bits_as_decode_tiles")]
            lines.append(
                f"| {r['shape']} | {r['name']} | {r.get('config')} | {r['us']:,.0f} | {speed} | {ratio} | {bits} |"
            )
    return "\n".join(lines) + "\n"


def main():
    ap = _flags.parser(__doc__)
    ap.add_argument("--shapes", default=SHAPES, help="B x T of the forward and backward rows, comma-separated")
    ap.add_argument("--launches", default=LAUNCHES, help="forward launches long_rows:long_warps:stages:tiles")
    ap.add_argument(
        "--backward", default=BACKWARD, help="flash-backward tiles block_q:block_k:warps:stages:dq_block_q:dq_block_k"
    )
    ap.add_argument("--backward-shapes", default="8x1024,1x8192,1x16384", help="B x T of the backward rows")
    ap.add_argument("--decode", default="1x8192,1x32768,16x8192,16x32768", help="batch x context of the decode rows")
    ap.add_argument("--before", default=None, help="another pallas_kernels/attention.py to time beside")
    ap.add_argument("--sections", default="forward,forward_backward,decode", help="which sections to run")
    _flags.add_repeats(ap, 5)
    _flags.add_out(ap)
    args = ap.parse_args()
    pairs = lambda s: [tuple(int(x) for x in item.split("x")) for item in s.split(",") if item]  # noqa: E731
    report = _report.new_report("bench.attention_long")
    report["ceilings"] = ceilings(args.repeats)
    bw, rate = report["ceilings"]["copy_bandwidth_Bps"], report["ceilings"]["dot_bf16_flops"]
    before = load_before(args.before)

    def add(row):
        report["results"].append(row)
        print(json.dumps(row), flush=True)
        _report.save_report(report, args.out)

    sections = args.sections.split(",")
    if "forward" in sections:
        forward_rows(pairs(args.shapes), parse(args.launches, 4), before, rate, args.repeats, add)
    if "forward_backward" in sections:
        backward_rows(pairs(args.backward_shapes), parse(args.backward, 6), before, rate, args.repeats, add)
    if "decode" in sections:
        decode_rows(pairs(args.decode), before, bw, args.repeats, add)
    table = markdown(report["results"])
    report["markdown"] = table
    _report.save_report(report, args.out)
    print(table)
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, jnp.dot {rate / 1e12:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
