"""One speed harness: strict vs fast side by side, with the ceilings measured in the same run.

    python -m bench.speed                       # everything (one H200 device call)
    python -m bench.speed --quick               # 0.6B + 8B decode at batch 1/64, small learner/score rows
    python -m bench.speed --only decode,kernels --models qwen3-8b
    python -m bench.speed --merge a.json b.json --out all.json   # one table from runs side by side

Sections (each row: fast, strict, strict/fast time, fraction of a ceiling):
- ceilings: device-to-device copy bandwidth (bytes read + written) and `jnp.dot` bf16 at 8192^3;
- decode: tokens/s at batch 1/16/64/256 x context 512/2048, `--steps` decode steps (forward + fused
  sampling) inside ONE jitted fori_loop, so GPU time, not Python; HBM fraction = (weight bytes + KV
  bytes read per step) / step time / copy bandwidth. The cache is filled with random values (the
  time does not depend on them; prefilling 256 x 2048 tokens would take longer than the decode);
- prefill: 16 x 2048 prompt tokens, one call;
- learner: value and gradient of the GRPO loss (train.grpo.grpo_loss: bf16 policy from fp32 master
  weights, token-level PPO-clip) on random sequences; MFU = (6 x matmul params x tokens + causal
  attention 6 x L x Hq x Dh x T^2 per sequence) / time / 989 TFLOP/s; memory from XLA's compiled
  memory analysis (arguments + outputs + temporaries: the peak of that call); `--learner-remat` adds
  each row again with train.grpo --remat (layers recomputed in the backward) for the speed it costs,
  `--learner-dense` with XLA's dense attention backward instead of the Pallas flash one,
  `--learner-copies` with the matmul backward multiplying transposed copies (the default reads its
  operands in place); the `train` side (`--learner-sides`) times train.grpo's own one-device learner step
  (fsdp.sharded_value_and_grad on a one-device mesh: the same whole-weights pass, plus the fp32
  running sum of gradients it donates) next to `strict` (grpo_loss on whole weights, layers unrolled);
- score: the learner's forward + logprobs (`rlkjax.score`'s jitted core, the verify pass);
- kernels: each kernel alone against its XLA counterpart at decode and learner shapes.
Times are medians of `--repeats` timed calls after a warm-up call. JSON to --out.
"""

import argparse
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import rlkjax
from bench._report import median_time, new_report, save_report
from pallas_kernels import attention, logprob, matmul, rmsnorm, swiglu
from pallas_kernels._common import interpret_mode
from rlkjax import model, numerics
from rlkjax.engine import prefill_chunk
from rlkjax.numerics import PAGE_SIZE
from train import fsdp, grpo
from train.batch import Batch

PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16 datasheet
BF16, F32 = jnp.bfloat16, jnp.float32
SIDES = ("fast", "strict")
NAN = float("nan")


def rand(key, shape, dtype=BF16, scale=1.0):
    return (scale * jax.random.normal(jax.random.key(key), shape, F32)).astype(dtype)


# ----- ceilings -----
def ceilings(repeats):
    small = jax.default_backend() == "cpu"  # a smoke run of the harness, not a measurement
    x = jnp.arange(2**20 if small else 2**30, dtype=F32)  # 4 GiB
    copy = jax.jit(lambda x: x + 0)  # one read + one write per element

    def ten_copies():
        for _ in range(10):
            y = copy(x)
        y.block_until_ready()

    bw = 2 * x.nbytes * 10 / median_time(ten_copies, repeats)
    n = 256 if small else 8192
    a, b = rand(1, (n, n)), rand(2, (n, n))
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=F32).astype(BF16))

    def ten_dots():
        for _ in range(10):
            y = dot(a, b)
        y.block_until_ready()

    rate = 2 * n**3 * 10 / median_time(ten_dots, repeats)
    return {"copy_bandwidth_Bps": bw, "dot_bf16_flops": rate, "dot_size": n}


# ----- model rows -----
def matmul_params(cfg):
    per_layer = sum(int(np.prod(s)) for n, s in model.layer_shapes(cfg).items() if n in model.MATRICES)
    return cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size


def weight_bytes(params):
    """What a decode step reads: every weight once (the embedding gather reads B rows, so a tied
    embedding counts once, as the lm_head)."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    return total - (params["embed_tokens"].nbytes if "lm_head" in params else 0)


@functools.partial(jax.jit, static_argnames=("cfg", "numerics", "steps"), donate_argnames=("cache",))
def decode_loop(params, tokens, start, cache, page_table, seeds, temps, rope, cfg, numerics, steps):
    """`steps` decode steps feeding each sampled token back in: the engine's decode_step, in one loop."""

    def body(i, carry):
        tok, cache, _ = carry
        hidden, cache = model.forward(params, tok, (start + i)[:, None], cache, page_table, rope, cfg, numerics)
        nxt, lp = model.sample(params, hidden[:, 0], seeds, jnp.full_like(seeds, i), temps, numerics)
        return nxt[:, None], cache, lp

    tok, cache, lp = jax.lax.fori_loop(0, steps, body, (tokens, cache, jnp.zeros(tokens.shape[0], F32)))
    return tok, lp, cache


@functools.partial(jax.jit, static_argnames=("cfg", "num_pages"))
def random_cache(cfg, num_pages):
    """KV pages filled with random bf16 values (a random block tiled, so no fp32 temporary)."""
    block = rand(5, (cfg.num_layers, cfg.num_kv_heads, 16, PAGE_SIZE, cfg.head_dim))
    reps = -(-num_pages // 16)
    k = jnp.tile(block, (1, 1, reps, 1, 1))[:, :, :num_pages]
    return k, jnp.flip(k, axis=2)


def decode_rows(cfg, params, batches, contexts, steps, repeats, bw, name, unroll=1):
    """Decode rows; unroll: the sampler's layer-loop unroll (NumericsOptions.layer_unroll) they run with."""
    rows = []
    rope = model.rope_tables(cfg)
    wbytes = weight_bytes(params)
    max_ctx = max(contexts)
    for batch in batches:
        pages_per_row = -(-(max_ctx + steps) // PAGE_SIZE)
        page_table = jnp.asarray(1 + np.arange(batch * pages_per_row, dtype=np.int32).reshape(batch, pages_per_row))
        cache = random_cache(cfg, 1 + batch * pages_per_row)
        seeds, temps = jnp.arange(batch, dtype=jnp.uint32), jnp.ones((batch,), F32)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, 1)), jnp.int32)
        for ctx in contexts:
            row = {"section": "decode", "model": name, "batch": batch, "context": ctx, "steps": steps}
            row |= {"layer_unroll": unroll} if unroll != 1 else {}
            start = jnp.full((batch,), ctx - 1, jnp.int32)
            table = page_table[:, : -(-(ctx + steps) // PAGE_SIZE)]  # the fast path's attention reads every listed page
            for side in SIDES:

                def run():
                    nonlocal cache
                    options = numerics.NumericsOptions(mode=side, layer_unroll=unroll)
                    _, lp, cache = decode_loop(
                        params, tokens, start, cache, table, seeds, temps, rope, cfg, options, steps
                    )
                    lp.block_until_ready()

                dt = median_time(run, repeats) / steps
                kv = batch * (ctx + steps / 2) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
                row[f"{side}_tokens_per_s"] = batch / dt
                row[f"{side}_ms_per_step"] = 1e3 * dt
                row[f"{side}_hbm_fraction"] = (wbytes + kv) / dt / bw
            row["strict_over_fast"] = row["strict_ms_per_step"] / row["fast_ms_per_step"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del cache
    return rows


def prefill_row(cfg, params, batch, length, repeats, rate, name):
    rope = model.rope_tables(cfg)
    pages_per_row = -(-length // PAGE_SIZE)
    page_table = jnp.asarray(1 + np.arange(batch * pages_per_row, dtype=np.int32).reshape(batch, pages_per_row))
    cache = model.init_kv_cache(cfg, 1 + batch * pages_per_row)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, length)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    row = {"section": "prefill", "model": name, "batch": batch, "length": length}
    flops = (
        2 * matmul_params(cfg) * batch * length + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * length**2 * batch
    )
    for side in SIDES:

        def run():
            nonlocal cache
            cache = prefill_chunk(params, tokens, positions, cache, page_table, rope, cfg, side)
            jax.block_until_ready(cache)

        dt = median_time(run, repeats)
        row[f"{side}_tokens_per_s"] = batch * length / dt
        row[f"{side}_mfu"] = flops / dt / PEAK_BF16_FLOPS
        row[f"{side}_dot_fraction"] = flops / dt / rate
    row["strict_over_fast"] = row["fast_tokens_per_s"] / row["strict_tokens_per_s"]
    print(json.dumps(row), flush=True)
    return row


def compiled_bytes(compiled):
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def learner_batch(cfg, b, seq):
    """Random recorded sequences [b, seq] as the learner's typed Batch (every token trained)."""
    rng = np.random.default_rng(0)
    return Batch(
        tokens=jnp.asarray(rng.integers(0, cfg.vocab_size, (b, seq)), jnp.int32),
        positions=jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (b, seq)),
        logp_old=jnp.asarray(-rng.random((b, seq - 1)) * 3, F32),
        mask=jnp.ones((b, seq - 1), F32),
        adv=jnp.asarray(rng.standard_normal(b), F32),
        temps=jnp.ones((b,), F32),
        tis=jnp.ones((b, seq - 1), F32),
    )


def train_learner_step(master, batch, ref, rope, cfg, remat, options="strict"):
    """train.grpo's learner step on one device, as train() builds it: fsdp.sharded_value_and_grad on a
    one-device mesh (whole weights, as the library's pass: fsdp.gather only casts there; gradients
    added into a donated running sum). Returns (jitted step, its arguments but the running sum, a fresh running sum)."""
    mesh = fsdp.make_mesh(jax.devices()[:1])
    specs = fsdp.param_specs(master, 1)
    step = fsdp.sharded_value_and_grad(
        grpo.grpo_loss, mesh, specs, dtype=cfg.dtype, cfg=cfg, numerics=options, clip_eps=0.2, beta=0.0, remat=remat
    )
    on_mesh = fsdp.put(master, mesh, specs, dtype=F32)
    tokens = float(np.asarray(batch.mask).sum())
    args = (
        on_mesh,
        fsdp.put(batch, mesh, fsdp.ROWS),
        fsdp.put(ref, mesh, fsdp.ROWS),
        fsdp.put(rope, mesh, fsdp.REPLICATED),
        fsdp.put(np.float32(tokens), mesh, fsdp.REPLICATED),
    )
    return step, args, jax.tree.map(jnp.zeros_like, on_mesh)


def learner_row(cfg, name, seq, tokens_per_call, repeats, rate, remat=False, sides=SIDES, strict="strict"):
    """sides: "fast" and "strict" run grpo.grpo_loss on whole weights (the library's learner pass:
    layers unrolled, weights read in place); "train" runs train.grpo's one-device learner step
    (`train_learner_step`, strict), so the two can be compared in one run. strict: the strict
    sides' numerics (a NumericsOptions choosing the backward variants)."""
    b = max(1, tokens_per_call // seq)
    master = model.init_params(cfg, seed=0, dtype=F32)
    batch = learner_batch(cfg, b, seq)
    rope = model.rope_tables(cfg)
    ref = jnp.zeros((b, seq - 1), F32)
    flops = 6 * matmul_params(cfg) * b * seq + 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq**2 * b
    row = {"section": "learner", "model": name, "seq": seq, "batch": b, "remat": remat}
    for side in sides:
        if side == "train":
            fn, args, grads = train_learner_step(master, batch, ref, rope, cfg, remat, strict)
            args = (*args, grads)
        else:
            loss = functools.partial(grpo.grpo_loss, remat=remat)
            fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=(4, 5, 6, 7))
            args = (master, batch, ref, rope, cfg, strict if side == "strict" else side, 0.2, 0.0, jnp.float32(b * seq))
        try:
            start = time.perf_counter()
            compiled = fn.lower(*args).compile()
            row[f"{side}_compile_s"] = time.perf_counter() - start
            if side == "train":  # the running sum is donated: each call takes the last one's
                state = {"grads": args[-1]}

                def call():
                    state["grads"] = jax.block_until_ready(compiled(*args[:-1], state["grads"]))[1]

            else:

                def call():
                    jax.block_until_ready(compiled(*args[:4], args[8]))

            dt = median_time(call, repeats)
        except (jax.errors.JaxRuntimeError, NotImplementedError) as e:  # out of memory, a failed lowering: results too
            row[f"{side}_error"] = str(e)[:160]
            continue
        row[f"{side}_tokens_per_s"] = b * seq / dt
        row[f"{side}_mfu"] = flops / dt / PEAK_BF16_FLOPS
        row[f"{side}_dot_fraction"] = flops / dt / rate
        row[f"{side}_memory_GiB"] = compiled_bytes(compiled) / 2**30
    if "fast_tokens_per_s" in row and "strict_tokens_per_s" in row:
        row["strict_over_fast"] = row["fast_tokens_per_s"] / row["strict_tokens_per_s"]
    print(json.dumps(row), flush=True)
    return row


def score_row(cfg, params, name, b, seq, repeats):
    rope = model.rope_tables(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (b, seq)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (b, seq))
    temps = jnp.ones((b,), F32)
    row = {"section": "score", "model": name, "batch": b, "seq": seq}
    for side in SIDES:
        fn = jax.jit(model.sequence_logprobs, static_argnames=("cfg", "numerics"))
        compiled = fn.lower(params, tokens, positions, temps, rope, cfg=cfg, numerics=side).compile()
        dt = median_time(lambda: jax.block_until_ready(compiled(params, tokens, positions, temps, rope)), repeats)
        row[f"{side}_tokens_per_s"] = b * seq / dt
        row[f"{side}_memory_GiB"] = compiled_bytes(compiled) / 2**30
    row["strict_over_fast"] = row["fast_tokens_per_s"] / row["strict_tokens_per_s"]
    print(json.dumps(row), flush=True)
    return row


# ----- kernels alone -----
def attention_only(q, pages, plan, config, side):
    """Attention over a filled cache without the KV write (a write into an undonated cache would
    time a copy of the whole cache): the strict kernel, or the fast path's XLA attention. plan:
    `attention_plan(...)` with the same config, made outside the timed call."""
    if side == "strict":
        return attention._padded_attention(q, pages, pages, jnp.int32(0), plan, config, interpret_mode())[0]
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


def _loop_time(step, init, consts, iters, repeats):
    """Seconds per iteration of step(i, carry, consts) run `iters` times in one jitted fori_loop.
    Arrays go in as arguments: a closed-over array would become an HLO constant."""
    f = jax.jit(lambda c, consts: jax.lax.fori_loop(0, iters, lambda i, c: step(i, c, consts), c))
    return median_time(lambda: jax.block_until_ready(f(init, consts)), repeats) / iters, f


def matmul_stacked_time(m, k, n, layers, config, repeats, which="strict"):
    """Per-matmul time of x [m, k] @ w[i].T over `layers` stacked weights (each read from HBM)."""
    ws = rand(2, (layers, n, k), scale=0.02)
    x0 = rand(1, (m, k))
    interp = interpret_mode()  # compiled on a GPU; interpreted on the CPU (tests/test_bench.py)

    def step(i, x, ws):
        if which == "strict":
            y = matmul.matmul_layer(x, ws, i, None, config, interp)
        elif which == "sliced":
            y = matmul.matmul(x, ws[i], None, config, interp)
        else:
            y = jnp.dot(x, ws[i].T, preferred_element_type=F32).astype(BF16)
        return jnp.tile(y, (1, -(-k // n)))[:, :k] if n < k else y[:, :k]

    t, _ = _loop_time(step, x0, ws, layers, repeats)
    return t, n * k * 2 / t


def kernel_rows(bw, rate, repeats):
    rows = []
    interp = interpret_mode()  # compiled on a GPU; interpreted on the CPU (tests/test_bench.py)
    # Decode-shaped matmuls: 8B gate/up (K 4096 -> N 12288) and down (12288 -> 4096), weights streamed.
    for k, n in ((4096, 12288), (12288, 4096), (1024, 1024)):
        for m in (1, 16, 64, 256):
            cfg = numerics.matmul_config(m)
            tf, _ = matmul_stacked_time(m, k, n, 36, cfg, repeats, "xla")
            ts, _ = matmul_stacked_time(m, k, n, 36, cfg, repeats, "strict")
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
    # Learner/prefill matmul.
    m, k, n = 8192, 4096, 12288
    x, w = rand(1, (m, k)), rand(2, (n, k), scale=0.02)
    xla = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=F32).astype(BF16))
    pal = jax.jit(lambda x, w: matmul.matmul(x, w, None, numerics.matmul_config(m), interp))
    tf = median_time(lambda: xla(x, w).block_until_ready(), repeats)
    ts = median_time(lambda: pal(x, w).block_until_ready(), repeats)
    rows.append(
        {
            "section": "kernel",
            "kernel": "matmul (learner)",
            "shape": f"M={m} K={k} N={n}",
            "fast_us": 1e6 * tf,
            "strict_us": 1e6 * ts,
            "strict_over_fast": ts / tf,
            "strict_fraction": 2 * m * n * k / ts / rate,
            "ceiling": "jnp.dot rate",
        }
    )
    print(json.dumps(rows[-1]), flush=True)
    # SwiGLU at the learner's shape.
    g, u = rand(3, (m, n)), rand(4, (m, n))
    fs = jax.jit(lambda g, u: swiglu.swiglu(g, u, numerics.SWIGLU, interp))
    fx = jax.jit(swiglu.swiglu_reference)
    tf = median_time(lambda: fx(g, u).block_until_ready(), repeats)
    ts = median_time(lambda: fs(g, u).block_until_ready(), repeats)
    rows.append(
        {
            "section": "kernel",
            "kernel": "swiglu",
            "shape": f"{m}x{n}",
            "fast_us": 1e6 * tf,
            "strict_us": 1e6 * ts,
            "strict_over_fast": ts / tf,
            "strict_fraction": 3 * m * n * 2 / ts / bw,
            "ceiling": "copy bandwidth",
        }
    )
    print(json.dumps(rows[-1]), flush=True)
    # Attention, decode (8B heads, batch 64, context 2048) and prefill (one 4096-token sequence).
    hq, hkv, dh = 32, 8, 128
    for b, t, ctx in ((1, 1, 2048), (64, 1, 2048), (1, 4096, 4096)):
        q, pages, pt, pos = attention_case(b, t, ctx, hq, hkv, dh)
        ps, px = attention_plan(pt, pos, hq, hkv, numerics.ATTENTION), attention_plan(pt, pos, hq, hkv, None)
        fs = jax.jit(functools.partial(attention_only, config=numerics.ATTENTION, side="strict"))
        fx = jax.jit(functools.partial(attention_only, config=None, side="fast"))
        tf = median_time(lambda: fx(q, pages, px).block_until_ready(), repeats)
        ts = median_time(lambda: fs(q, pages, ps).block_until_ready(), repeats)
        kv_bytes = 2 * b * ctx * hkv * dh * 2
        rows.append(
            {
                "section": "kernel",
                "kernel": "attention",
                "shape": f"B={b} T={t} ctx={ctx} Hq={hq} Hkv={hkv}",
                "fast_us": 1e6 * tf,
                "strict_us": 1e6 * ts,
                "strict_over_fast": ts / tf,
                "strict_fraction": max(kv_bytes / ts / bw, causal_flops(pos, hq, dh) / ts / rate),
                "ceiling": "max(copy bandwidth (KV bytes), jnp.dot rate)",
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    # Logprob head, 8B lm_head: a decode step of 16 rows, and the learner's 8192 rows.
    vocab, d = 151936, 4096
    w = rand(10, (vocab, d), scale=0.02)
    for n_rows in (1, 16, 256, 8192):
        h = rand(11, (n_rows, d))
        tg = jnp.zeros((n_rows,), jnp.int32)
        tp = jnp.ones((n_rows,), F32)
        fs = jax.jit(lambda h, w: logprob.token_logprobs(h, w, tg, tp, numerics.LOGPROB, interp))
        fx = jax.jit(lambda h, w: logprob.token_logprobs_reference(h, w, tg, tp))
        tf = median_time(lambda: fx(h, w).block_until_ready(), repeats)
        ts = median_time(lambda: fs(h, w).block_until_ready(), repeats)
        rows.append(
            {
                "section": "kernel",
                "kernel": "logprob head",
                "shape": f"N={n_rows} V={vocab} D={d}",
                "fast_us": 1e6 * tf,
                "strict_us": 1e6 * ts,
                "strict_over_fast": ts / tf,
                "strict_fraction": max(w.nbytes / ts / bw, 2 * n_rows * vocab * d / ts / rate),
                "ceiling": "max(copy bandwidth, jnp.dot rate)",
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


# ----- tile sweep (re-tuning on another GPU; --only sweep) -----
def sweep_rows(bw, rate, repeats, parts):
    """Tile configs side by side at decode and learner shapes; 'same_bits' compares row 0 of each
    result with the first config's (a row's bits must not depend on the M/N tiles)."""
    rows = []
    mc = matmul.MatmulConfig

    def add(row):
        rows.append(row | {"section": "sweep"})
        print(json.dumps(rows[-1]), flush=True)

    def attempt(what, shape, config, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 (a config Triton cannot compile is a result too)
            add({"what": what, "shape": shape, "config": str(config), "error": str(e)[:200]})

    decode = {
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
    shapes = ((4096, 12288, (1, 64, 128, 256)), (4096, 1024, (1,)), (4096, 4096, (1, 256)), (12288, 4096, (1, 256)))
    for k, n, ms in shapes if "matmul" in parts else ():
        ws = rand(2, (36, n, k), scale=0.02)
        for m in ms:
            x0 = rand(1, (m, k))
            ref = None
            for c in [mc(*t) for t in decode[m]] + [mc(64, 64, 32, 4, 3)]:  # the last: every matmul's tile before
                for how in ("stacked", "sliced") if c.block_k == 32 else ("stacked",):

                    def step(i, carry, ws, c=c, how=how):
                        x, _ = carry
                        if how == "stacked":
                            y = matmul.matmul_layer(x, ws, i, None, c, interpret_mode())
                        else:
                            y = matmul.matmul(x, ws[i], None, c, interpret_mode())
                        return (jnp.tile(y, (1, -(-k // n)))[:, :k] if n < k else y[:, :k]), y[0, :64]

                    init = (x0, jnp.zeros(64, BF16))
                    r = attempt("matmul", f"M={m} K={k} N={n}", c, lambda: _loop_time(step, init, ws, 36, repeats))
                    if r is None:
                        continue
                    t, f = r
                    out = np.asarray(f(init, ws)[1].astype(F32))
                    ref = out if ref is None else ref
                    add(
                        {
                            "what": "matmul",
                            "shape": f"M={m} K={k} N={n}",
                            "config": [c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages],
                            "how": how,
                            "us": 1e6 * t,
                            "hbm_fraction": n * k * 2 / t / bw,
                            "same_bits": bool(np.array_equal(out, ref)),
                        }
                    )
    # q/k/v of a decode step (8B): one fused launch vs three (the model reads them fused in place).
    qkv = [rand(2 + i, (36, n, 4096), scale=0.02) for i, n in enumerate((4096, 1024, 1024))]
    for how in ("fused", "separate") if "qkv" in parts else ():

        def qkv_step(i, x, ws, how=how):
            c = numerics.MATMUL_DECODE
            if how == "fused":
                ys = matmul.matmul_layer_fused(x, ws, i, c, interpret_mode())
            else:
                ys = [matmul.matmul_layer(x, w, i, None, c, interpret_mode()) for w in ws]
            return ys[0] + jnp.tile(ys[1], (1, 4)) + jnp.tile(ys[2], (1, 4))

        x0 = rand(1, (16, 4096))
        r = attempt("qkv", "M=1 K=4096 N=4096+1024+1024", how, lambda: _loop_time(qkv_step, x0, qkv, 36, repeats))
        if r is not None:
            add({"what": "qkv", "how": how, "us": 1e6 * r[0], "hbm_fraction": 6144 * 4096 * 2 / r[0] / bw})
    # RMSNorm tiles: a decode step's 16 padded rows (one real) and the learner's 8192 rows.
    for n_rows, d in ((16, 4096), (16, 1024), (8192, 4096), (8192, 2048)) if "rmsnorm" in parts else ():
        norms = (1 + rand(3, (36, d), scale=0.1)).astype(BF16)
        for t in ((16, 256, 4), (1, 1024, 4), (1, 256, 4), (1, 1024, 8), (1, 4096, 4), (4, 1024, 4)):
            c = rmsnorm.RMSNormConfig(*t)

            def norm_step(i, x, ws, c=c):
                return rmsnorm.rmsnorm_layer(x, ws, i, None, None, 1e-6, c, interpret_mode())

            x0 = rand(1, (n_rows, d))
            r = attempt("rmsnorm", f"{n_rows}x{d}", c, lambda: _loop_time(norm_step, x0, norms, 36, repeats))
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
    m, k, n = 8192, 4096, 12288
    x, w = rand(1, (m, k)), rand(2, (n, k), scale=0.02)
    ref = None
    for t in (
        ()
        if "learner_matmul" not in parts
        else [
            (128, 128, 128, 8, 3),
            (128, 128, 64, 8, 3),
            (128, 256, 64, 8, 3),
            (128, 256, 128, 8, 2),
            (64, 64, 32, 4, 3),
        ]
    ):
        c = mc(*t)
        f = jax.jit(lambda x, w, c=c: matmul.matmul(x, w, None, c, interpret_mode()))
        dt = attempt(
            "matmul", f"M={m} K={k} N={n}", c, lambda: median_time(lambda: f(x, w).block_until_ready(), repeats)
        )
        if dt is None:
            continue
        out = np.asarray(f(x[:16], w).astype(F32))
        ref = out if ref is None else ref
        add(
            {
                "what": "matmul",
                "shape": f"M={m} K={k} N={n}",
                "config": list(t),
                "us": 1e6 * dt,
                "dot_fraction": 2 * m * n * k / dt / rate,
                "same_bits": bool(np.array_equal(out, ref)),
            }
        )
    if "attention" in parts:
        attention_sweep(bw, rate, repeats, add)
    if "attention_bwd" in parts:
        attention_bwd_sweep(rate, repeats, add)
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
            f = jax.jit(lambda q, k, v, out, lse, do, c=c: attention_bwd(q, k, v, out, lse, do, pos, c, interp))
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


# ----- report -----
def merge_reports(paths):
    """One report from several runs: every row, and each run's command, date, hardware and ceilings
    (each row's fractions were computed against its own run's ceilings)."""
    parts = []
    for path in paths:
        with open(path) as f:
            parts.append(json.load(f))
    keys = ("command", "date", "hardware", "backend", "versions", "ceilings")
    return dict(
        parts[0],
        command=" && ".join(p["command"] for p in parts),
        parts=[{k: p.get(k) for k in keys} for p in parts],
        results=[r for p in parts for r in p["results"]],
    )


def print_table(report):
    for c in [p["ceilings"] for p in report.get("parts", ())] or [report["ceilings"]]:
        print(
            f"\nceilings: copy {c['copy_bandwidth_Bps'] / 1e9:.0f} GB/s, "
            f"jnp.dot bf16 {c.get('dot_size', 8192)}^3 {c['dot_bf16_flops'] / 1e12:.0f} TFLOP/s, "
            f"MFU against {PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s"
        )
    print(
        f"{'section':8} {'model':11} {'shape':28} {'fast':>10} {'strict':>10} {'unit':9} "
        f"{'strict/fast':>11} {'strict ceiling':>16}"
    )
    for r in report["results"]:
        s = r["section"]
        if s == "decode":
            shape, unit = f"batch {r['batch']} ctx {r['context']}", "tok/s"
            shape += f" unroll {r['layer_unroll']}" if "layer_unroll" in r else ""
            f, st, ceil = r["fast_tokens_per_s"], r["strict_tokens_per_s"], f"{100 * r['strict_hbm_fraction']:.0f}% HBM"
        elif s in ("prefill", "learner", "score"):
            shape = f"{r['batch']} x {r.get('length', r.get('seq'))}" + (" remat" if r.get("remat") else "")
            shape += " dense-bwd" if r.get("flash_backward") is False else ""
            shape += " copies" if r.get("matmul_backward_in_place") is False else ""
            f, st, unit = r.get("fast_tokens_per_s", NAN), r.get("strict_tokens_per_s", NAN), "tok/s"
            ceil = f"{100 * r['strict_mfu']:.0f}% MFU" if "strict_mfu" in r else ""
            if "train_mfu" in r:
                ceil += f" (train.grpo {100 * r['train_mfu']:.0f}%)"
            if "strict_memory_GiB" in r:
                ceil += f" {r['strict_memory_GiB']:.0f}/{r.get('fast_memory_GiB', NAN):.0f} GiB"
        else:
            shape, unit = r["shape"][:28], "us"
            f, st, ceil = r["fast_us"], r["strict_us"], f"{100 * r['strict_fraction']:.0f}%"
        name = r.get("model", r.get("kernel", ""))[:11]
        print(
            f"{s:8} {name:11} {shape:28} {f:10.1f} {st:10.1f} {unit:9} "
            f"{r.get('strict_over_fast', NAN):11.2f} {ceil:>16}"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-4b,qwen3-8b", help="decode model shapes (random weights)")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per timed loop")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per row (median)")
    ap.add_argument(
        "--layer-unroll",
        default="1",
        help="decode rows once per value: layers per iteration of the sampler's layer loop (same bits)",
    )
    ap.add_argument("--learner-models", default="qwen3-1.7b,qwen3-4b")
    ap.add_argument("--learner-seqs", default="1024,4096")
    ap.add_argument(
        "--learner-sides",
        default="fast,strict,train",
        help="learner rows: fast and strict (grpo_loss on whole weights), train (train.grpo's one-device step, strict)",
    )
    ap.add_argument(
        "--learner-remat", action="store_true", help="learner rows also with train.grpo --remat (side by side)"
    )
    ap.add_argument(
        "--learner-dense",
        action="store_true",
        help="learner rows also with XLA's dense attention backward (side by side with the flash one)",
    )
    ap.add_argument(
        "--learner-copies",
        action="store_true",
        help="learner rows also with the matmul backward on transposed copies of dy, w, x (side by side)",
    )
    ap.add_argument("--learner-tokens", type=int, default=8192, help="tokens per learner call (batch = tokens / seq)")
    ap.add_argument("--prefill", default="16x2048", help="prefill rows x prompt tokens")
    ap.add_argument("--score-model", default="qwen3-8b")
    ap.add_argument("--score", default="16x1024", help="scored rows x tokens")
    ap.add_argument("--only", default="decode,prefill,learner,score,kernels", help="sections to run (also: sweep)")
    ap.add_argument(
        "--sweep",
        default="matmul,qkv,rmsnorm,learner_matmul,attention,attention_bwd",
        help="parts of the tile sweep (--only sweep): matmul, qkv, rmsnorm, learner_matmul, attention "
        "(forward: query tiles per program, warps, stages; bits compared), attention_bwd",
    )
    ap.add_argument("--quick", action="store_true", help="a subset that fits a short device call")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/speed_<date>.json)")
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="measure nothing: join these runs' JSON (e.g. the sections of one device call, run on its GPUs "
        "side by side) into one report at --out and print its table",
    )
    args = ap.parse_args()
    if args.merge:
        report = merge_reports(args.merge)
        save_report(report, args.out)
        print_table(report)
        return
    if args.quick:
        args.models, args.batches, args.learner_models, args.learner_seqs = (
            "qwen3-0.6b,qwen3-8b",
            "1,64",
            "qwen3-1.7b",
            "1024",
        )
    # As `python -m train.grpo` does, before JAX starts (its default is 75% of the GPU): in session 10 the train
    # side of the 4B x 2 x 4096 learner row ran out of memory inside that 75%, which train.grpo does not use.
    grpo.claim_device_memory()
    sections = set(args.only.split(","))
    report = new_report("bench.speed")
    out = args.out or f"bench/results/speed_{report['date'][:10]}.json"

    def record(rows):  # saved after every row, so a run cut short keeps what it measured
        report["results"].extend(rows)
        save_report(report, out)

    report["ceilings"] = c = ceilings(args.repeats)
    print(json.dumps(c), flush=True)
    bw, rate = c["copy_bandwidth_Bps"], c["dot_bf16_flops"]
    if "sweep" in sections:
        report["sweep"] = sweep_rows(bw, rate, args.repeats, set(args.sweep.split(",")))
        save_report(report, out)
    for name in args.models.split(","):
        if not sections & {"decode", "prefill", "score"}:
            break
        cfg = rlkjax.ModelConfig.preset(name)
        params = rlkjax.init_params(cfg, seed=0)
        for unroll in map(int, args.layer_unroll.split(",")) if "decode" in sections else ():
            batches, contexts = [int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")]
            record(decode_rows(cfg, params, batches, contexts, args.steps, args.repeats, bw, name, unroll))
        if "score" in sections and name == args.score_model:
            record([score_row(cfg, params, name, *map(int, args.score.split("x")), args.repeats)])
        if "prefill" in sections:
            record([prefill_row(cfg, params, *map(int, args.prefill.split("x")), args.repeats, rate, name)])
        del params
    if "learner" in sections:
        for name in args.learner_models.split(","):
            for seq in map(int, args.learner_seqs.split(",")):
                for remat in sorted({False, args.learner_remat}):
                    for flash in sorted({True, not args.learner_dense}, reverse=True):
                        for in_place in sorted({True, not args.learner_copies}, reverse=True):
                            strict = numerics.NumericsOptions(
                                attention_backward="flash" if flash else "dense",
                                matmul_backward="in_place" if in_place else "copies",
                            )
                            cfg = rlkjax.ModelConfig.preset(name)
                            # The backward switches change only the strict side: the fast side runs once.
                            sides = args.learner_sides.split(",") if flash and in_place else ("strict",)
                            row = learner_row(
                                cfg, name, seq, args.learner_tokens, args.repeats, rate, remat, sides, strict
                            )
                            record([dict(row, flash_backward=flash, matmul_backward_in_place=in_place)])
    if "kernels" in sections:
        record(kernel_rows(bw, rate, args.repeats))
    print_table(report)


if __name__ == "__main__":
    main()
