"""bench.speed's tile sweep (`--only sweep`, for re-tuning on another GPU): kernel configs side by side
at decode and learner shapes, each output's bits compared with the first config's where bits are promised."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import BF16, F32, loop_time, median_time, rand
from bench.speed_kernels import attention_case, attention_only, attention_plan, causal_flops
from pallas_kernels import attention, matmul, rmsnorm
from pallas_kernels.common import interpret_mode
from rlkjax.core import numerics

# Matmul tiles (block_m, block_n, block_k, warps, stages) tried per decode M; the last config of every
# list (64, 64, 32, 4, 3) was every matmul's tile before the per-shape tables.
DECODE_TILES = {
    1: [
        (16, 32, 128, 4, 4),
        (16, 32, 64, 4, 4),
        (16, 64, 128, 4, 4),
        (16, 32, 128, 4, 6),
        (16, 32, 128, 2, 4),
        (16, 32, 256, 4, 3),
        (16, 16, 128, 4, 4),
    ],
    64: [(64, 32, 128, 4, 4), (64, 64, 128, 4, 4), (64, 64, 64, 4, 4), (32, 32, 128, 4, 4)],
    128: [(64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (128, 64, 128, 4, 3), (128, 128, 64, 4, 3)],
    256: [
        (64, 64, 128, 4, 4),
        (64, 128, 128, 4, 3),
        (64, 128, 128, 4, 4),
        (64, 128, 64, 4, 4),
        (64, 256, 64, 4, 3),
        (128, 64, 128, 4, 3),
        (128, 128, 64, 4, 3),
        (128, 128, 64, 8, 4),
        (128, 128, 128, 8, 3),
        (128, 256, 64, 8, 3),
    ],
}
LEARNER_TILES = [
    (128, 128, 128, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 256, 128, 8, 2),
    (64, 64, 32, 4, 3),
]
LAYERS = 36  # stacked weights per loop, as Qwen3-8B's


def attempt(add, what, shape, config, fn):
    """fn()'s result, or None after adding an error row (a config Triton cannot compile is a result too)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        add({"what": what, "shape": shape, "config": str(config), "error": str(e)[:200]})


def decode_matmul_sweep(bw, repeats, add):
    """Decode-shaped matmuls over stacked weights (8B's gate/up, q, o/down; k/v), in place ("stacked") or on
    a sliced layer; row 0's bits compared with the first config's."""
    shapes = ((4096, 12288, (1, 64, 128, 256)), (4096, 1024, (1,)), (4096, 4096, (1, 256)), (12288, 4096, (1, 256)))
    for k, n, ms in shapes:
        ws = rand(2, (LAYERS, n, k), scale=0.02)
        for m in ms:
            x0, ref = rand(1, (m, k)), None
            for c in [matmul.MatmulConfig(*t) for t in DECODE_TILES[m] + [(64, 64, 32, 4, 3)]]:
                for how in ("stacked", "sliced") if c.block_k == 32 else ("stacked",):

                    def step(i, carry, ws, c=c, how=how):
                        x, _ = carry
                        if how == "stacked":
                            y = matmul.product(x, ws, c, interpret_mode(), layer=i)
                        else:
                            y = matmul.matmul(x, ws[i], None, c, interpret_mode())
                        return (jnp.tile(y, (1, -(-k // n)))[:, :k] if n < k else y[:, :k]), y[0, :64]

                    init = (x0, jnp.zeros(64, BF16))
                    shape = f"M={m} K={k} N={n}"
                    r = attempt(add, "matmul", shape, c, lambda: loop_time(step, init, ws, LAYERS, repeats))
                    if r is None:
                        continue
                    t, f = r
                    out = np.asarray(f(init, ws)[1].astype(F32))
                    ref = out if ref is None else ref
                    add(
                        {
                            "what": "matmul",
                            "shape": shape,
                            "config": [c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages],
                            "how": how,
                            "us": 1e6 * t,
                            "hbm_fraction": n * k * 2 / t / bw,
                            "same_bits": bool(np.array_equal(out, ref)),
                        }
                    )


def qkv_sweep(bw, repeats, add):
    """q/k/v of a decode step (8B): one fused launch vs three (the model reads them fused in place)."""
    qkv = [rand(2 + i, (LAYERS, n, 4096), scale=0.02) for i, n in enumerate((4096, 1024, 1024))]
    for how in ("fused", "separate"):

        def qkv_step(i, x, ws, how=how):
            c = numerics.MATMUL_DECODE
            if how == "fused":
                ys = matmul.fused_product(x, ws, i, c, interpret_mode())
            else:
                ys = [matmul.product(x, w, c, interpret_mode(), layer=i) for w in ws]
            return ys[0] + jnp.tile(ys[1], (1, 4)) + jnp.tile(ys[2], (1, 4))

        x0 = rand(1, (16, 4096))
        shape = "M=1 K=4096 N=4096+1024+1024"
        r = attempt(add, "qkv", shape, how, lambda: loop_time(qkv_step, x0, qkv, LAYERS, repeats))
        if r is not None:
            add({"what": "qkv", "how": how, "us": 1e6 * r[0], "hbm_fraction": 6144 * 4096 * 2 / r[0] / bw})


def rmsnorm_sweep(bw, repeats, add):
    """RMSNorm tiles: a decode step's 16 padded rows (one real) and the learner's 8192 rows."""
    for n_rows, d in ((16, 4096), (16, 1024), (8192, 4096), (8192, 2048)):
        norms = (1 + rand(3, (LAYERS, d), scale=0.1)).astype(BF16)
        for t in ((16, 256, 4), (1, 1024, 4), (1, 256, 4), (1, 1024, 8), (1, 4096, 4), (4, 1024, 4)):
            c = rmsnorm.RMSNormConfig(*t)

            def norm_step(i, x, ws, c=c):
                return rmsnorm.rmsnorm_layer(x, ws, i, None, None, 1e-6, c, interpret_mode())

            x0 = rand(1, (n_rows, d))
            r = attempt(add, "rmsnorm", f"{n_rows}x{d}", c, lambda: loop_time(norm_step, x0, norms, LAYERS, repeats))
            if r is not None:
                add(
                    {
                        "what": "rmsnorm",
                        "shape": f"{n_rows}x{d}",
                        "config": list(t),
                        "us": 1e6 * r[0],
                        "hbm_fraction": 2 * n_rows * d * 2 / r[0] / bw,
                    }
                )


def learner_matmul_sweep(rate, repeats, add):
    """The learner's matmul (8B's gate/up over 8192 rows); the first 16 rows' bits compared with the first
    config's."""
    m, k, n = 8192, 4096, 12288
    x, w = rand(1, (m, k)), rand(2, (n, k), scale=0.02)
    ref = None
    for t in LEARNER_TILES:
        c = matmul.MatmulConfig(*t)
        f = jax.jit(lambda x, w, c=c: matmul.matmul(x, w, None, c, interpret_mode()))
        shape = f"M={m} K={k} N={n}"
        dt = attempt(add, "matmul", shape, c, lambda: median_time(lambda: f(x, w).block_until_ready(), repeats))
        if dt is None:
            continue
        out = np.asarray(f(x[:16], w).astype(F32))
        ref = out if ref is None else ref
        add(
            {
                "what": "matmul",
                "shape": shape,
                "config": list(t),
                "us": 1e6 * dt,
                "dot_fraction": 2 * m * n * k / dt / rate,
                "same_bits": bool(np.array_equal(out, ref)),
            }
        )


def sweep_rows(bw, rate, repeats, parts):
    """Tile configs side by side at decode and learner shapes, for the parts named (matmul, qkv, rmsnorm,
    learner_matmul, attention, attention_bwd, decode_attention); 'same_bits' compares a config's output with the first
    config's where a row's bits must not depend on the tiles."""
    rows = []

    def add(row):
        rows.append(row | {"section": "sweep"})
        print(json.dumps(rows[-1]), flush=True)

    if "matmul" in parts:
        decode_matmul_sweep(bw, repeats, add)
    if "qkv" in parts:
        qkv_sweep(bw, repeats, add)
    if "rmsnorm" in parts:
        rmsnorm_sweep(bw, repeats, add)
    if "learner_matmul" in parts:
        learner_matmul_sweep(rate, repeats, add)
    if "attention" in parts:
        attention_sweep(bw, rate, repeats, add)
    if "attention_bwd" in parts:
        attention_bwd_sweep(rate, repeats, add)
    if "decode_attention" in parts:
        decode_attention_sweep(bw, repeats, add)
    return rows


def attention_sweep(bw, rate, repeats, add, shapes=None, configs=None):
    """The attention forward's program shapes at Qwen3-4B/8B heads (32 query, 8 KV heads of 128),
    1.7B's learner (16 query heads) and a 0.6B decode step: query tiles per program x warps x
    stages, each output compared bit for bit with the first config's (one tile on 4 warps; a config
    that changes a bit may not be adopted)."""
    shapes = shapes or [
        (2, 4096, 4096, 16, 8, 128),
        (2, 4096, 4096, 32, 8, 128),
        (8, 1024, 1024, 32, 8, 128),
        (64, 1, 2048, 32, 8, 128),
        (1, 1, 512, 16, 8, 128),
    ]
    never = 2**30  # merge_in_kernel_from: always the split kernels and the merge kernel
    configs = configs or [
        (1, 4, 2, never),
        (2, 2, 2, never),
        (2, 2, 2, 8),
        (4, 2, 2, 8),
        (4, 4, 2, 8),
        (8, 4, 2, 8),
        (2, 2, 3, 8),
        (2, 4, 2, 8),
        (1, 2, 2, 8),
        (1, 1, 2, never),
    ]
    for b, t, ctx, hq, hkv, dh in shapes:
        q, pages, pt, pos = attention_case(b, t, ctx, hq, hkv, dh)
        ref, flops = None, causal_flops(pos, hq, dh)
        for tiles, warps, stages, merge_from in configs:
            config = [tiles, warps, stages, merge_from]
            c = dataclasses.replace(
                numerics.ATTENTION, tiles=tiles, num_warps=warps, num_stages=stages, merge_in_kernel_from=merge_from
            )
            plan = attention_plan(pt, pos, hq, hkv, c)
            f = jax.jit(functools.partial(attention_only, config=c, side="strict"))
            shape = f"B={b} T={t} ctx={ctx} Hq={hq} Hkv={hkv} Dh={dh}"
            try:
                dt = median_time(lambda: f(q, pages, plan).block_until_ready(), repeats)
            except Exception as e:  # noqa: BLE001 (a config Triton cannot compile is a result too)
                add({"what": "attention", "shape": shape, "config": config, "error": str(e)[:200]})
                continue
            out = np.asarray(f(q, pages, plan)).view(np.uint16)
            ref = out if ref is None else ref
            add(
                {
                    "what": "attention",
                    "shape": shape,
                    "config": config,
                    "config_keys": ["tiles", "num_warps", "num_stages", "merge_in_kernel_from"],
                    "us": 1e6 * dt,
                    "tflops": flops / dt / 1e12,
                    "dot_fraction": flops / dt / rate,
                    "kv_bytes_fraction": 2 * b * ctx * hkv * dh * 2 / dt / bw,
                    "same_bits": bool(np.array_equal(out, ref)),
                }
            )


# Decode attention at long contexts, (kv_split, merge_prefetch, merge_block_d, merge_warps): the
# shipped table's first; then the merge as it ran before its loads went ahead (one split a step,
# whole rows, the attention's 2 warps), other merge launches, and other split sizes (a contract
# setting: they change the bits, of both sides alike).
DECODE_ATTENTION_CONFIGS = [
    (256, 8, 32, 4),
    (256, 1, 128, 2),
    (256, 4, 32, 4),
    (256, 8, 16, 4),
    (256, 8, 64, 8),
    (128, 8, 32, 4),
    (512, 8, 32, 4),
]


def decode_attention_sweep(bw, repeats, add, shapes=None, configs=None, iters=LAYERS):
    """A decode step's attention (one token per row over a filled cache) at Qwen3-8B heads, batch 1
    and 16, 2k to 32k keys: KV split size x the merge kernel's launch, each timed in a loop of `iters`
    calls on the device (each call's output is the next one's query, so none is hoisted), with its
    share of the KV bytes' copy ceiling; the loop's last output compared bit for bit with the first
    config's (merge launches must keep the bits; another kv_split may not). At batch 1 and 2k keys
    the cache (8 MB) stays in L2 between calls: that row overstates the bandwidth."""
    shapes = shapes or [(b, ctx, 32, 8, 128) for b in (1, 16) for ctx in (2048, 8192, 16384, 32768)]
    for b, ctx, hq, hkv, dh in shapes:
        q, pages, pt, pos = attention_case(b, 1, ctx, hq, hkv, dh)
        ref, shape = None, f"B={b} T=1 ctx={ctx} Hq={hq} Hkv={hkv} Dh={dh}"
        for config in configs or DECODE_ATTENTION_CONFIGS:
            kv_split, prefetch, block_d, warps = config
            c = dataclasses.replace(
                numerics.ATTENTION,
                kv_split=kv_split,
                block_pages=min(numerics.ATTENTION.block_pages, kv_split // numerics.PAGE_SIZE),  # tiny splits
                merge_prefetch=prefetch,
                merge_block_d=block_d,
                merge_warps=warps,
            )
            plan = attention_plan(pt, pos, hq, hkv, c)

            def step(i, q, consts, c=c):
                return attention_only(q, *consts, config=c, side="strict")

            r = attempt(
                add, "decode_attention", shape, config, lambda: loop_time(step, q, (pages, plan), iters, repeats)
            )
            if r is None:
                continue
            t, f = r
            out = np.asarray(f(q, (pages, plan))).view(np.uint16)
            ref = out if ref is None else ref
            add(
                {
                    "what": "decode_attention",
                    "shape": shape,
                    "config": list(config),
                    "config_keys": ["kv_split", "merge_prefetch", "merge_block_d", "merge_warps"],
                    "us": 1e6 * t,
                    "kv_bytes_fraction": 2 * b * ctx * hkv * dh * 2 / t / bw,
                    "same_bits": bool(np.array_equal(out, ref)),
                }
            )


def attention_bwd_sweep(rate, repeats, add, shapes=None, configs=None):
    """The learner's attention backward (dq, dk, dv from the forward's out and log-sum-exp) at
    Qwen3-1.7B and 4B heads: block_q x block_k x warps x stages. Gradients are not bitwise-promised across
    configs (only run to run), so this is a speed table; FLOPs counted as 2x the forward's."""
    from pallas_kernels.attention_bwd import AttentionBwdConfig, attention_bwd

    shapes = shapes or [(2, 4096, 16, 8, 128), (2, 4096, 32, 8, 128), (8, 1024, 32, 8, 128)]
    configs = configs or [
        (64, 64, 4, 2),
        (64, 64, 8, 2),
        (64, 64, 2, 2),
        (64, 32, 4, 2),
        (32, 32, 4, 2),
        (32, 64, 2, 2),
        (128, 128, 8, 3),
    ]
    for b, t, hq, hkv, dh in shapes:
        q, do = rand(1, (b, t, hq, dh)), rand(2, (b, t, hq, dh))
        k, v = rand(3, (b, t, hkv, dh)), rand(4, (b, t, hkv, dh))
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        out = jax.jit(lambda q, k, v: attention.dense_attention(q, k, v, pos))(q, k, v)
        lse = jnp.zeros((b, t, hq), F32)  # the time does not depend on the values
        flops = 2 * causal_flops(pos, hq, dh)
        interp = interpret_mode()
        for bq, bk, warps, stages in configs:
            c = AttentionBwdConfig(block_q=bq, block_k=bk, num_warps=warps, num_stages=stages)
            f = jax.jit(lambda q, k, v, out, lse, do, c=c: attention_bwd(q, k, v, (out, lse), do, pos, c, interp))
            shape = f"B={b} T={t} Hq={hq} Hkv={hkv} Dh={dh}"
            try:
                dt = median_time(lambda: jax.block_until_ready(f(q, k, v, out, lse, do)), repeats)
            except Exception as e:  # noqa: BLE001
                add({"what": "attention_bwd", "shape": shape, "config": [bq, bk, warps, stages], "error": str(e)[:200]})
                continue
            add(
                {
                    "what": "attention_bwd",
                    "shape": shape,
                    "config": [bq, bk, warps, stages],
                    "config_keys": ["block_q", "block_k", "num_warps", "num_stages"],
                    "us": 1e6 * dt,
                    "tflops": flops / dt / 1e12,
                    "dot_fraction": flops / dt / rate,
                }
            )
