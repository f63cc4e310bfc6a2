"""bench.speed's kernel rows: each strict kernel alone against its XLA counterpart at decode and learner
shapes, with the fraction of a ceiling it reaches."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import BF16, F32, loop_time, median_time, rand
from pallas_kernels import attention, logprob, matmul, swiglu
from pallas_kernels.common import interpret_mode
from rlkjax.core import numerics
from rlkjax.core.numerics import PAGE_SIZE


def attention_only(q, pages, plan, config, side):
    """Attention over a filled cache without the KV write (a write into an undonated cache would
    time a copy of the whole cache): the strict kernel, or the fast path's XLA attention. plan:
    `attention_plan(...)` with the same config, made outside the timed call."""
    if side == "strict":
        return attention.padded_attention(q, pages, pages, jnp.int32(0), plan, config, interpret_mode())[0]
    _, hkv, _, ps, dh = pages.shape
    b, p = plan.page_table.shape
    keys = pages[0][:, plan.page_table].reshape(hkv, b, p * ps, dh).transpose(1, 2, 0, 3)
    mask = (jnp.arange(p * ps)[None, None, :] <= plan.positions[:, :, None])[:, None]
    return jax.nn.dot_product_attention(q, keys, keys, mask=mask, implementation="xla")


def attention_case(b, t, ctx, hq, hkv, dh):
    """q [b, t, hq, dh] at positions ctx-t .. ctx-1 of b rows over a random cache [1, hkv, ...]."""
    ppr = -(-ctx // PAGE_SIZE)
    pages = rand(6, (1, hkv, 1 + b * ppr, PAGE_SIZE, dh))
    pt = jnp.asarray(1 + np.arange(b * ppr, dtype=np.int32).reshape(b, ppr))
    pos = jnp.broadcast_to(jnp.arange(ctx - t, ctx, dtype=jnp.int32), (b, t))
    return rand(7, (b, t, hq, dh)), pages, pt, pos


def attention_plan(pt, pos, hq, hkv, config):
    return attention.plan(pt, pos, hq // hkv, PAGE_SIZE, config)


def causal_flops(pos, hq, dh):
    """q k^T and p v over every visible (query, key) pair: 4 x Hq x Dh per pair."""
    return 4 * hq * dh * float(np.sum(np.asarray(pos, np.int64) + 1))


def matmul_stacked_time(m, k, n, layers, config, repeats, which="strict"):
    """Per-matmul time of x [m, k] @ w[i].T over `layers` stacked weights (each read from HBM)."""
    ws = rand(2, (layers, n, k), scale=0.02)
    x0 = rand(1, (m, k))
    interp = interpret_mode()  # compiled on a GPU; interpreted on the CPU (tests/test_bench.py)

    def step(i, x, ws):
        if which == "strict":
            y = matmul.product(x, ws, config, interp, layer=i)
        elif which == "sliced":
            y = matmul.matmul(x, ws[i], None, config, interp)
        else:
            y = jnp.dot(x, ws[i].T, preferred_element_type=F32).astype(BF16)
        return jnp.tile(y, (1, -(-k // n)))[:, :k] if n < k else y[:, :k]

    t, _ = loop_time(step, x0, ws, layers, repeats)
    return t, n * k * 2 / t


@dataclasses.dataclass(frozen=True)
class KernelShapes:
    """The shapes the kernel rows run at."""

    decode_matmuls: tuple = ((4096, 12288), (12288, 4096), (1024, 1024))  # (K, N): 8B gate/up, down; 0.6B-like
    decode_rows: tuple = (1, 16, 64, 256)  # M of a decode step's matmuls
    layers: int = 36  # stacked weights, each read from HBM once per loop iteration
    learner: tuple = (8192, 4096, 12288)  # (M, K, N) of the learner's / prefill's matmul and SwiGLU
    heads: tuple = (32, 8, 128)  # (Hq, Hkv, Dh): Qwen3-8B's attention
    attention: tuple = ((1, 1, 2048), (64, 1, 2048), (1, 4096, 4096))  # (B, T, context): decode, prefill
    vocab: int = 151936  # the logprob head: Qwen3's vocabulary over 8B's width
    width: int = 4096
    logprob_rows: tuple = (1, 16, 256, 8192)  # a decode step's rows .. the learner's


# On the CPU (interpret mode) the rows only check the harness, at shapes that take seconds.
CPU_SHAPES = KernelShapes(
    decode_matmuls=((128, 64),),
    decode_rows=(1, 16),
    layers=2,
    learner=(32, 64, 128),
    heads=(4, 2, 16),
    attention=((2, 1, 48), (1, 32, 32)),
    vocab=300,
    width=64,
    logprob_rows=(1, 16),
)


def kernel_row(kernel, shape, fast, strict, repeats, fraction, ceiling):
    """Times fast() and strict() (each blocks); fraction(seconds) -> the strict side's fraction of `ceiling`."""
    tf, ts = median_time(fast, repeats), median_time(strict, repeats)
    row = {
        "section": "kernel",
        "kernel": kernel,
        "shape": shape,
        "fast_us": 1e6 * tf,
        "strict_us": 1e6 * ts,
        "strict_over_fast": ts / tf,
        "strict_fraction": fraction(ts),
        "ceiling": ceiling,
    }
    print(json.dumps(row), flush=True)
    return row


def decode_matmul_rows(s, bw, repeats):
    """Decode-shaped matmuls over stacked weights (loop_time already gives seconds per call)."""
    rows = []
    for k, n in s.decode_matmuls:
        for m in s.decode_rows:
            cfg = numerics.matmul_config(m)
            tf, _ = matmul_stacked_time(m, k, n, s.layers, cfg, repeats, "xla")
            ts, _ = matmul_stacked_time(m, k, n, s.layers, cfg, repeats, "strict")
            row = {
                "section": "kernel",
                "kernel": "matmul (decode, stacked weights)",
                "shape": f"M={m} K={k} N={n}",
                "fast_us": 1e6 * tf,
                "strict_us": 1e6 * ts,
                "strict_over_fast": ts / tf,
                "strict_fraction": (n * k * 2 + m * (k + n) * 2) / ts / bw,
                "ceiling": "copy bandwidth",
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def learner_matmul_rows(s, bw, rate, repeats):
    """The learner's / prefill's matmul, and SwiGLU at its output's shape."""
    interp = interpret_mode()
    m, k, n = s.learner
    x, w = rand(1, (m, k)), rand(2, (n, k), scale=0.02)
    xla = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=F32).astype(BF16))
    pal = jax.jit(lambda x, w: matmul.matmul(x, w, None, numerics.matmul_config(m), interp))
    g, u = rand(3, (m, n)), rand(4, (m, n))
    fs = jax.jit(lambda g, u: swiglu.swiglu(g, u, numerics.SWIGLU, interp))
    fx = jax.jit(swiglu.swiglu_reference)
    return [
        kernel_row(
            "matmul (learner)",
            f"M={m} K={k} N={n}",
            lambda: xla(x, w).block_until_ready(),
            lambda: pal(x, w).block_until_ready(),
            repeats,
            lambda ts: 2 * m * n * k / ts / rate,
            "jnp.dot rate",
        ),
        kernel_row(
            "swiglu",
            f"{m}x{n}",
            lambda: fx(g, u).block_until_ready(),
            lambda: fs(g, u).block_until_ready(),
            repeats,
            lambda ts: 3 * m * n * 2 / ts / bw,
            "copy bandwidth",
        ),
    ]


def attention_rows(s, bw, rate, repeats):
    """The attention kernel without the KV write against XLA's attention: decode steps and a prefill."""
    hq, hkv, dh = s.heads
    rows = []
    for b, t, ctx in s.attention:
        q, pages, pt, pos = attention_case(b, t, ctx, hq, hkv, dh)
        ps, px = attention_plan(pt, pos, hq, hkv, numerics.ATTENTION), attention_plan(pt, pos, hq, hkv, None)
        fs = jax.jit(functools.partial(attention_only, config=numerics.ATTENTION, side="strict"))
        fx = jax.jit(functools.partial(attention_only, config=None, side="fast"))
        kv_bytes, flops = 2 * b * ctx * hkv * dh * 2, causal_flops(pos, hq, dh)
        rows.append(
            kernel_row(
                "attention",
                f"B={b} T={t} ctx={ctx} Hq={hq} Hkv={hkv}",
                lambda: fx(q, pages, px).block_until_ready(),
                lambda: fs(q, pages, ps).block_until_ready(),
                repeats,
                lambda ts: max(kv_bytes / ts / bw, flops / ts / rate),
                "max(copy bandwidth (KV bytes), jnp.dot rate)",
            )
        )
    return rows


def logprob_rows(s, bw, rate, repeats):
    """The logprob head (lm_head, log-softmax, the target's logprob) against its XLA reference."""
    interp = interpret_mode()
    w = rand(10, (s.vocab, s.width), scale=0.02)
    rows = []
    for n_rows in s.logprob_rows:
        h = rand(11, (n_rows, s.width))
        tg, tp = jnp.zeros((n_rows,), jnp.int32), jnp.ones((n_rows,), F32)
        fs = jax.jit(lambda h, w: logprob.head(h, w, tp, numerics.LOGPROB, interp, targets=tg).logprobs)
        fx = jax.jit(lambda h, w: logprob.head_reference(h, w, tp, targets=tg).logprobs)
        flops = 2 * n_rows * s.vocab * s.width
        rows.append(
            kernel_row(
                "logprob head",
                f"N={n_rows} V={s.vocab} D={s.width}",
                lambda: fx(h, w).block_until_ready(),
                lambda: fs(h, w).block_until_ready(),
                repeats,
                lambda ts: max(w.nbytes / ts / bw, flops / ts / rate),
                "max(copy bandwidth, jnp.dot rate)",
            )
        )
    return rows


def kernel_rows(bw, rate, repeats, shapes=None):
    """Every kernel row; shapes: KernelShapes (default: the GPU's, or CPU_SHAPES on the CPU)."""
    s = shapes or (CPU_SHAPES if jax.default_backend() == "cpu" else KernelShapes())
    return [
        *decode_matmul_rows(s, bw, repeats),
        *learner_matmul_rows(s, bw, rate, repeats),
        *attention_rows(s, bw, rate, repeats),
        *logprob_rows(s, bw, rate, repeats),
    ]
