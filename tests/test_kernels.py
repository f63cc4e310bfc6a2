"""Each Pallas kernel against its plain-JAX reference: values and gradients.

Tolerances are derived, not tuned: the truth is a float64 evaluation of the same function on the
same (already rounded) inputs. The kernel and its reference share every rounding point, so their
errors against the truth differ only by fp32 accumulation order (~sqrt(K) * 2**-24 relative),
which is far below the output rounding (2**-8 for bf16). The kernel may therefore be at most 2x
as far from the truth as the reference is; a real bug (a wrong mask, a dropped tile, a missed
term) is an O(1) error and fails by orders of magnitude. The same rule applies to gradients,
computed in fp32 against a float64 jax.grad of the reference.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention, logprob, logprob_bwd, matmul, rmsnorm, swiglu
from rlkjax.core import numerics
from tests.helpers import INTERPRET, assert_bits_equal, float64_on_cpu, randn, rel_err, slow

BF16, F32 = jnp.bfloat16, jnp.float32

# Inputs are built on the host (numpy) and kernels run inside jax.jit: op by op, every jnp call and
# every primitive of a kernel's wrapper compiled as a program of its own, for each new shape.


def f32(a):
    """a in float32, converted on the host (exact from bfloat16)."""
    return jnp.asarray(np.asarray(a, np.float32))


def host_ints(key, shape, high):
    return jnp.asarray(np.random.default_rng(key).integers(0, high, shape, dtype=np.int32))


def host_full(shape, value, dtype=np.float32):
    return jnp.asarray(np.full(shape, value, dtype))


def check_against_truth(kernel_fn, reference_fn, args, what, truth_fn=None):
    """kernel(args) vs reference(args), both vs truth_fn (default: the reference) in float64. Each
    side runs as one jitted program: op by op, every primitive of the reference and of the kernel's
    wrapper compiled as a program of its own, dozens per shape."""
    out_k, out_r = jax.jit(kernel_fn)(*args), jax.jit(reference_fn)(*args)
    with float64_on_cpu():
        args64 = [
            jnp.asarray(np.asarray(a, np.float64))
            if jnp.issubdtype(a.dtype, jnp.floating)
            else jnp.asarray(np.asarray(a))
            for a in args
        ]
        truth = jax.jit(truth_fn or reference_fn)(*args64)
    for k, r, t in zip(jax.tree.leaves(out_k), jax.tree.leaves(out_r), jax.tree.leaves(truth)):
        ek, er = rel_err(k, t), rel_err(r, t)
        assert np.isfinite(ek) and ek <= 2 * er + 1e-7, f"{what}: kernel error {ek:.3g} vs reference error {er:.3g}"


def check_grads(kernel_fn, reference_fn, args, argnums, what):
    """Gradients of sum(f * fixed random weights) in fp32 vs a float64 jax.grad of the reference."""
    cot = None

    def loss(fn):
        def f(*a):
            out = fn(*a)
            return jnp.sum(out.astype(jnp.float64 if out.dtype == jnp.float64 else F32) * cot.astype(out.dtype))

        return f

    out = jax.eval_shape(reference_fn, *args)
    cot = jnp.asarray(np.random.default_rng(7).standard_normal(out.shape, np.float32))
    grad_k = jax.jit(jax.grad(loss(kernel_fn), argnums))
    gk = grad_k(*args)
    gr = jax.jit(jax.grad(loss(reference_fn), argnums))(*args)
    with float64_on_cpu():
        args64 = [
            jnp.asarray(np.asarray(a, np.float64))
            if jnp.issubdtype(a.dtype, jnp.floating)
            else jnp.asarray(np.asarray(a))
            for a in args
        ]
        cot = jnp.asarray(np.asarray(cot, np.float64))
        gt = jax.jit(jax.grad(loss(reference_fn), argnums))(*args64)
        gt = [np.asarray(g) for g in gt]
    for i, (k, r, t) in enumerate(zip(gk, gr, gt)):
        ek, er = rel_err(k, t), rel_err(r, t)
        assert np.isfinite(ek) and ek <= 2 * er + 1e-6, (
            f"{what} grad {i}: kernel error {ek:.3g} vs reference error {er:.3g}"
        )
    # Deterministic backward: the same call twice gives the same bits.
    for a, b in zip(gk, grad_k(*args)):
        assert_bits_equal(a, b, f"{what} backward run to run")


# The default run keeps the case that pads every dimension; the other shapes run with the slow tests.
@pytest.mark.parametrize("m,k,n", [slow(37, 96, 128), slow(130, 64, 64), slow(1, 256, 192), (21, 40, 37)])
def test_matmul(m, k, n):
    mm = lambda x, w, r: matmul.matmul(x, w, r, numerics.MATMUL, INTERPRET)  # noqa: E731
    args = [randn(1, (m, k), BF16), randn(2, (n, k), BF16, 0.1), randn(3, (m, n), BF16)]
    check_against_truth(mm, matmul.matmul_reference, args, "matmul")
    args32 = [f32(a) for a in args]
    check_grads(mm, matmul.matmul_reference, args32, (0, 1, 2), "matmul")


@pytest.mark.parametrize("m,k,n", [slow(37, 96, 128), slow(130, 64, 64), (21, 40, 37)])
def test_matmul_backward_in_place(m, k, n):
    """MatmulConfig.backward_in_place: dx and dw from kernels that read dy, w and x where they lie
    (no transposed copies) are as accurate as XLA's (check_grads: within twice the reference's own
    error against float64, and the same bits when run twice), in fp32 and in bf16."""
    c = dataclasses.replace(numerics.MATMUL, backward_in_place=True)
    mm = lambda x, w, r: matmul.matmul(x, w, r, c, INTERPRET)  # noqa: E731
    args = [randn(1, (m, k), BF16), randn(2, (n, k), BF16, 0.1), randn(3, (m, n), BF16)]
    check_grads(mm, matmul.matmul_reference, [f32(a) for a in args], (0, 1, 2), "matmul in place, fp32")
    check_grads(mm, matmul.matmul_reference, args, (0, 1), "matmul in place, bf16")


_matmul = jax.jit(matmul.matmul, static_argnums=(3, 4))
_product = jax.jit(matmul.product, static_argnums=(2, 3), static_argnames=("layout",))
_fused_product = jax.jit(matmul.fused_product, static_argnums=(3, 4))


def test_matmul_row_invariance():
    """A row's bits must not depend on how many rows are in the call or where it sits in its tile."""
    x, w = np.asarray(randn(1, (200, 128), BF16)), randn(2, (192, 128), BF16, 0.1)
    full = np.asarray(_matmul(x, w, None, numerics.MATMUL, INTERPRET))
    for lo, hi in [(0, 1), (63, 64), (37, 101), (5, 200)]:
        assert_bits_equal(_matmul(x[lo:hi], w, None, numerics.MATMUL, INTERPRET), full[lo:hi], f"rows {lo}:{hi}")


# 40: padded to 64, or to RoPE halves of 32 ([x1, 0, x2, 0]); 640: the backward's 256-wide chunks
# (3, the last padded) or halves padded to 512
@pytest.mark.parametrize(
    "rope,d", [slow(False, 64), (False, 40), slow(False, 640), slow(True, 64), (True, 40), slow(True, 640)]
)
def test_rmsnorm(rope, d):
    """Values and gradients (the Pallas backward: 37 rows are 3 programs of partial weight
    gradients) against float64, gradients in fp32 and in bf16 (the model's dtype, where the
    reference's vjp rounds at each of its casts and the kernel once per output)."""
    n = 37
    x, w = randn(1, (n, d), BF16, 3.0), jnp.asarray((1 + np.asarray(randn(2, (d,), F32, 0.1))).astype(BF16))
    ang = np.asarray(randn(3, (n, d // 2)))
    cos, sin = (jnp.asarray(np.cos(ang)), jnp.asarray(np.sin(ang))) if rope else (None, None)
    ker = lambda x, w, c, s: rmsnorm.rmsnorm(x, w, c, s, 1e-6, numerics.rmsnorm_config(c), INTERPRET)  # noqa: E731
    ref = lambda x, w, c, s: rmsnorm.rmsnorm_reference(x, w, c, s, 1e-6)  # noqa: E731
    if rope:
        check_against_truth(ker, ref, [x, w, cos, sin], "rmsnorm+rope")
        check_grads(ker, ref, [f32(x), f32(w), cos, sin], (0, 1), "rmsnorm+rope")
        check_grads(ker, ref, [x, w, cos, sin], (0, 1), "rmsnorm+rope, bf16")
    else:
        ker2 = lambda x, w: ker(x, w, None, None)  # noqa: E731
        ref2 = lambda x, w: ref(x, w, None, None)  # noqa: E731
        check_against_truth(ker2, ref2, [x, w], "rmsnorm")
        check_grads(ker2, ref2, [f32(x), f32(w)], (0, 1), "rmsnorm")
        check_grads(ker2, ref2, [x, w], (0, 1), "rmsnorm, bf16")


@pytest.mark.parametrize("f", [slow(160), 100])
def test_swiglu(f):
    g, u = randn(1, (37, f), BF16, 2.0), randn(2, (37, f), BF16)
    ker = lambda g, u: swiglu.swiglu(g, u, numerics.SWIGLU, INTERPRET)  # noqa: E731
    check_against_truth(ker, swiglu.swiglu_reference, [g, u], "swiglu")
    check_grads(ker, swiglu.swiglu_reference, [f32(g), f32(u)], (0, 1), "swiglu")


def _attention_case(dtype, b=3, t=37, hq=4, hkv=2, dh=16, lens=(37, 20, 1)):
    """Host arrays q, k, v, the page table and the positions (-1: padding); the empty cache pages."""
    q, k, v = randn(1, (b, t, hq, dh), dtype), randn(2, (b, t, hkv, dh), dtype), randn(3, (b, t, hkv, dh), dtype)
    ps = numerics.ATTENTION.page_size
    p = -(-t // ps)
    page_table = (1 + np.arange(b * p, dtype=np.int32)).reshape(b, p)
    pos = np.arange(t, dtype=np.int32)[None, :]
    positions = np.where(pos < np.array(lens)[:, None], pos, -1).astype(np.int32)
    pages = np.zeros((2, hkv, 1 + b * p, ps, dh), dtype)
    return np.asarray(q), np.asarray(k), np.asarray(v), jnp.asarray(pages), page_table, positions


@functools.partial(jax.jit, static_argnames="config")
def _attend(q, k, v, kp, vp, layer, pt, pos, config=numerics.ATTENTION):
    """The strict attention with this call's plan (the model makes one per forward)."""
    plan = attention.plan(pt, pos, q.shape[2] // k.shape[2], config.page_size, config)
    out, (kp, vp) = attention.paged_attention(q, k, v, (kp, vp), layer, plan, config, INTERPRET)
    return out, kp, vp


# The default run checks values against dense attention in test_attention_kv_splits, gradients in
# test_attention_flash_backward.
@pytest.mark.slow
def test_attention_values_and_grads():
    q, k, v, pages, pt, pos = _attention_case(BF16)
    layer = np.int32(1)
    ker = lambda q, k, v: _attend(q, k, v, pages, pages, layer, pt, pos)[0]  # noqa: E731
    ref_plan = attention.plan(pt, pos, q.shape[2] // k.shape[2], numerics.PAGE_SIZE)
    ref = lambda q, k, v: attention.paged_attention_reference(q, k, v, (pages, pages), layer, ref_plan)[0]  # noqa: E731
    dense = lambda q, k, v: attention.dense_attention(q, k, v, pos)  # noqa: E731
    check_against_truth(ker, dense, [q, k, v], "attention vs dense")
    check_against_truth(ker, ref, [q, k, v], "attention vs paged reference", truth_fn=dense)
    q, k, v, pages, pt, pos = _attention_case(F32)
    check_grads(ker, lambda q, k, v: attention.dense_attention(q, k, v, pos), [q, k, v], (0, 1, 2), "attention")


def test_reference_attention_in_query_chunks(monkeypatch):
    """numerics="fast" at reasoning lengths: the stock-XLA attention splits a row's queries into chunks (each over
    all the keys), which gives the whole row's values and gradients, and keeps its fp32 scores to a chunk's: at
    Qwen3-8B's heads, 16,384 queries and keys, XLA's compiled temporaries fall from 64 GiB to 8.2."""
    q, k, v, pages, pt, pos = _attention_case(F32, t=48, lens=(48, 30, 5))
    layer = np.int32(1)
    ref_plan = attention.plan(pt, pos, q.shape[2] // k.shape[2], numerics.PAGE_SIZE)

    def ref(q, k, v):
        return attention.paged_attention_reference(q, k, v, (pages, pages), layer, ref_plan)[0]

    def chunked(q, k, v):  # traced with chunks of 16 queries: 48 queries in 3
        with monkeypatch.context() as m:
            m.setattr(attention, "REFERENCE_QUERY_CHUNK", 16)
            return ref(q, k, v)

    # against dense attention in float64, as close as the whole row's call (values; gradients through lax.map)
    dense = lambda q, k, v: attention.dense_attention(q, k, v, pos)  # noqa: E731
    check_against_truth(chunked, ref, [q, k, v], "reference attention in query chunks", truth_fn=dense)
    check_grads(chunked, dense, [q, k, v], (0, 1, 2), "reference attention in query chunks")

    monkeypatch.setattr(attention, "REFERENCE_QUERY_CHUNK", 2048)
    t, hq, hkv, dh, ps = 16384, 32, 8, 128, numerics.PAGE_SIZE
    shapes = [
        jax.ShapeDtypeStruct((1, t, hq, dh), BF16),
        jax.ShapeDtypeStruct((1, t, hkv, dh), BF16),
        jax.ShapeDtypeStruct((1, t, hkv, dh), BF16),
        jax.ShapeDtypeStruct((1, hkv, 1 + t // ps, ps, dh), BF16),
        jax.ShapeDtypeStruct((1, t // ps), jnp.int32),
        jax.ShapeDtypeStruct((1, t), jnp.int32),
    ]

    def layer_attention(q, k, v, kv, page_table, positions):
        plan = attention.plan(page_table, positions, hq // hkv, ps)
        return attention.paged_attention_reference(q, k, v, (kv, kv), np.int32(0), plan)[0]

    temp = jax.jit(layer_attention).lower(*shapes).compile().memory_analysis().temp_size_in_bytes
    assert temp < 9 * 2**30, f"{temp / 2**30:.1f} GiB of temporaries"


@pytest.mark.slow
@pytest.mark.parametrize("hq,hkv,dh", [(6, 2, 24), (5, 1, 8)])
def test_attention_odd_shapes(hq, hkv, dh):
    """Group sizes 3 and 5 (padded with zero query heads) and head dims 24 and 8 (zero features,
    scale from the true head dim): values and gradients as the dense reference's, and chunked
    prefill gives the whole pass's bits (the padded copy of the cache is the layer's own)."""
    case = dict(t=21, hq=hq, hkv=hkv, dh=dh, lens=(21, 9, 1))
    q, k, v, pages, pt, pos = _attention_case(BF16, **case)

    def run(q, k, v, sl, kp, vp):
        return _attend(q[:, sl], k[:, sl], v[:, sl], kp, vp, np.int32(1), pt, pos[:, sl])

    dense = lambda q, k, v: attention.dense_attention(q, k, v, pos)  # noqa: E731
    whole_pass = lambda q, k, v: run(q, k, v, slice(None), pages, pages)[0]  # noqa: E731
    check_against_truth(whole_pass, dense, [q, k, v], "odd attention vs dense")
    whole, _, _ = run(q, k, v, slice(None), pages, pages)
    a, kp, vp = run(q, k, v, slice(0, 12), pages, pages)
    b, _, _ = run(q, k, v, slice(12, None), kp, vp)
    assert_bits_equal(np.concatenate([a, b], axis=1), whole, "odd shapes: chunked prefill")
    q, k, v, pages, pt, pos = _attention_case(F32, **case)
    check_grads(whole_pass, dense, [q, k, v], (0, 1, 2), "odd attention")


# The default run's chunked prefill and decode check: test_attention_kv_splits[16-37-1].
@pytest.mark.parametrize("block_pages,kv_split,merge_from", [slow(None, None, None), slow(1, 32, 2)])
def test_attention_chunked_equals_whole_and_decode(block_pages, kv_split, merge_from):
    """Prefill in chunks of 20 + 17, or token by token, gives the whole pass's bits: the cache is
    written before it is read and KV blocks are aligned to absolute positions. With 16-key blocks,
    32-key splits and the in-kernel merge from 2 query tiles: the whole pass and the chunks merge
    their 2 splits in the attention kernel, where a decode step (one tile) merges them in the merge
    kernel: the same bits."""
    config = numerics.ATTENTION
    if block_pages:
        config = dataclasses.replace(
            config, block_pages=block_pages, kv_split=kv_split, merge_in_kernel_from=merge_from
        )
    q, k, v, pages, pt, pos = _attention_case(BF16)
    run = lambda sl, kp, vp: _attend(q[:, sl], k[:, sl], v[:, sl], kp, vp, np.int32(0), pt, pos[:, sl], config)  # noqa: E731
    whole, _, _ = run(slice(None), pages, pages)
    a, kp, vp = run(slice(0, 20), pages, pages)
    b, _, _ = run(slice(20, None), kp, vp)
    assert_bits_equal(np.concatenate([a, b], axis=1), whole, "chunked prefill")
    kp = vp = pages
    outs = []
    for t in range(q.shape[1]):
        o, kp, vp = run(slice(t, t + 1), kp, vp)
        outs.append(o)
    assert_bits_equal(np.concatenate(outs, axis=1), whole, "token-by-token decode")


def test_interpreted_backward_chunk_is_fixed():
    """Interpreted, the logprob backward walks Qwen3's vocabulary in 2,048-id chunks whatever the row
    count (each grid step copies the kernel's whole output: one vocabulary-wide chunk cost 17x more
    at 80 rows), so CPU gradient bits do not depend on the row count; a small vocabulary is one chunk;
    compiled, the chunk is as wide as memory allows for the rows."""
    for rows in (1, 80, 640, 20000):
        assert logprob_bwd.vocab_chunk(rows, 151936, 256, interpret=True) == 2048
        assert logprob_bwd.vocab_chunk(rows, 300, 256, interpret=True) == 512
    assert logprob_bwd.vocab_chunk(80, 151936, 256) == 152064
    assert logprob_bwd.vocab_chunk(20000, 151936, 256) == 6656


@pytest.mark.parametrize("in_place", [True, slow(False)])  # the backward's products reading dz, w, h in place or copies
@pytest.mark.parametrize("d,vocab", [slow(64, 512), (48, 300)])  # 48, 300: a padded K step and a padded vocab tile
def test_logprob_values_and_grads(d, vocab, in_place):
    n = 37
    h, w = randn(1, (n, d), BF16), randn(2, (vocab, d), BF16, 0.3)
    targets = host_ints(3, (n,), vocab)
    temps = jnp.asarray(np.array([0.7, 1.0, 1.3] * 12 + [1.0], np.float32))
    c = dataclasses.replace(
        numerics.LOGPROB, backward=dataclasses.replace(numerics.LOGPROB.backward, backward_in_place=in_place)
    )
    ker = lambda h, w: logprob.head(h, w, temps, c, INTERPRET, targets=targets).logprobs  # noqa: E731
    ref = lambda h, w: logprob.head_reference(h, w, temps, targets=targets).logprobs  # noqa: E731
    check_against_truth(ker, ref, [h, w], "token_logprobs")
    check_grads(ker, ref, [f32(h), f32(w)], (0, 1), "token_logprobs")


def test_logprob_gradient_of_a_greedy_row_is_temperature_1s():
    """The forward scores a greedy row (temperature 0) at temperature 1; the backward must as well: the
    same gradient bits as at temperature 1, where dividing by the temperature gave NaN."""
    n, d, vocab = 16, 48, 300
    h, w = randn(1, (n, d), BF16), randn(2, (vocab, d), BF16, 0.3)
    targets = host_ints(3, (n,), vocab)

    def grads(temperature):
        temps = host_full((n,), temperature)
        loss = lambda h, w: jnp.sum(logprob.head(h, w, temps, numerics.LOGPROB, INTERPRET, targets=targets).logprobs)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(h, w)

    for greedy, tempered, name in zip(grads(0.0), grads(1.0), ("dh", "dw")):
        assert_bits_equal(greedy, tempered, f"{name}: temperature 0 vs 1")


@pytest.mark.slow
def test_logprob_backward_in_vocab_chunks(monkeypatch):
    """The backward walks the vocabulary in chunks, each computing dz with the chunk's first id as
    an offset (target match, padded-id mask): in chunks of 128 ids, 300 ids take three, the last
    holding 84 padded ids. Gradients as accurate as XLA's (check_grads) and equal, up to fp32
    summation order, to the one-chunk backward's: dh sums the chunks' products in another grouping
    (bounded by the same check), dw's rows are computed independently of the chunking, so bit-equal."""
    n, d, vocab = 37, 64, 300
    h, w = randn(1, (n, d), BF16), randn(2, (vocab, d), BF16, 0.3)
    targets = jnp.asarray(np.array([0, 127, 128, 299] * 9 + [256], np.int32))  # ids on both sides of chunk edges
    temps = host_full((n,), 0.8)
    c = dataclasses.replace(numerics.LOGPROB, backward=dataclasses.replace(numerics.LOGPROB.backward, block_n=128))
    ker = lambda h, w: logprob.head(h, w, temps, c, INTERPRET, targets=targets).logprobs  # noqa: E731
    ref = lambda h, w: logprob.head_reference(h, w, temps, targets=targets).logprobs  # noqa: E731
    one_chunk = jax.jit(jax.grad(lambda w: jnp.sum(ker(h, w))))(w)
    monkeypatch.setattr(logprob_bwd, "BWD_CHUNK_BYTES", 4 * 64 * 128)  # room for 128 ids of 37 rows, not 256
    assert logprob_bwd.vocab_chunk(n, vocab, 128) == 128
    check_grads(ker, ref, [f32(h), f32(w)], (0, 1), "token_logprobs, 3 vocab chunks")
    assert_bits_equal(jax.jit(jax.grad(lambda w: jnp.sum(ker(h, w))))(w), one_chunk, "dw: 3 chunks vs 1")


@pytest.mark.parametrize("d,vocab", [slow(64, 512), (48, 300)])
def test_sample_logprob_is_score_logprob(d, vocab):
    """The sampler's recorded logprob is bit-identical to scoring the drawn token."""
    n = 37
    h, w = randn(1, (n, d), BF16), randn(2, (vocab, d), BF16, 0.3)
    temps = host_full((n,), 0.9)
    seeds, steps = jnp.asarray(np.arange(n, dtype=np.uint32)), jnp.asarray(np.arange(n, dtype=np.int32))
    tokens, lp = logprob.head(h, w, temps, numerics.LOGPROB, INTERPRET, seeds=seeds, steps=steps)[:2]
    assert_bits_equal(
        lp, logprob.head(h, w, temps, numerics.LOGPROB, INTERPRET, targets=tokens).logprobs, "sample vs score"
    )
    ref_tokens = logprob.head_reference(h, w, temps, seeds=seeds, steps=steps).tokens
    assert (np.asarray(tokens) == np.asarray(ref_tokens)).mean() > 0.9  # same noise, logits equal up to rounding


@pytest.mark.parametrize("vocab", [slow(512), 300])
def test_sampling_follows_the_distribution(vocab):
    """Uniform logits (zero hidden state): every id is equally likely, so 20,000 draws over 512 ids
    give counts with mean 39 and, for a fair sampler, a chi-square statistic near 511 (sd ~32);
    over 300 ids near 299 (sd ~24). With 300 ids the last tile holds 84 padded ids whose zero
    lm_head rows also give logit 0: were they not masked, they would be drawn (an id >= 300) and
    every logprob would be -log(384)."""
    n, d = 20000, 64
    h, w = jnp.asarray(np.zeros((n, d), BF16)), randn(2, (vocab, d), BF16)
    seeds, steps = jnp.asarray(np.arange(n, dtype=np.uint32)), jnp.asarray(np.zeros(n, np.int32))
    tokens, lp = logprob.head(h, w, host_full(n, 1.0), numerics.LOGPROB, INTERPRET, seeds=seeds, steps=steps)[:2]
    assert np.asarray(tokens).max() < vocab
    counts = np.bincount(np.asarray(tokens), minlength=vocab)
    chi2 = ((counts - n / vocab) ** 2 / (n / vocab)).sum()
    assert chi2 < (vocab - 1) + 5 * np.sqrt(2 * (vocab - 1)), chi2
    np.testing.assert_array_equal(np.asarray(lp), np.float32(-np.log(np.float32(vocab))))


def test_kernel_configs_validate():
    for bad in [dict(block_m=24), dict(block_k=8), dict(num_warps=3)]:
        with pytest.raises(ValueError, match="must be"):
            matmul.MatmulConfig(**bad)
    with pytest.raises(ValueError, match="page_size"):
        attention.AttentionConfig(page_size=12)


@pytest.mark.parametrize("splits", [slow(1), slow(2), 4])
def test_logprob_uneven_vocab_splits(splits):
    """640 ids = 5 tiles: 2 splits hold 3 + 2 tiles, 4 splits hold 2 + 2 + 1 + 0 (an empty range
    must merge as a no-op). Values match the reference; sampled logprobs match scored ones."""
    import dataclasses

    config = dataclasses.replace(numerics.LOGPROB, vocab_splits=splits, block_rows=16)
    n, d, vocab = 21, 64, 640
    h, w = randn(1, (n, d), BF16), randn(2, (vocab, d), BF16, 0.3)
    targets = host_ints(3, (n,), vocab)
    temps = host_full((n,), 1.1)
    ker = lambda h, w: logprob.head(h, w, temps, config, INTERPRET, targets=targets).logprobs  # noqa: E731
    check_against_truth(
        ker, lambda h, w: logprob.head_reference(h, w, temps, targets=targets).logprobs, [h, w], "split logprobs"
    )
    seeds, steps = jnp.asarray(np.arange(n, dtype=np.uint32)), jnp.asarray(np.zeros(n, np.int32))
    tokens, lp = logprob.head(h, w, temps, config, INTERPRET, seeds=seeds, steps=steps)[:2]
    assert_bits_equal(lp, logprob.head(h, w, temps, config, INTERPRET, targets=tokens).logprobs, "sample vs score")
    ref_tokens = logprob.head_reference(h, w, temps, seeds=seeds, steps=steps).tokens
    assert (np.asarray(tokens) == np.asarray(ref_tokens)).mean() > 0.9


# This machine's tile table: ROCm's on an AMD GPU (bench/rocm_check.sh runs this test there), CUDA's elsewhere.
TABLE = numerics.options("strict").resolved().tiles
MATMUL_CLASSES = [TABLE.matmul_decode, TABLE.matmul_small, TABLE.matmul_medium, TABLE.matmul]


# The default run checks decode's and the learner's tiles through the model: tests/test_contract.py.
@pytest.mark.slow
def test_matmul_tile_configs_agree():
    """Decode, prefill and the learner use different M/N/K tiles, warps and stages; a row's bits
    must not depend on which: otherwise sampler and learner logprobs would differ. Also: reading
    layer i out of a stacked [L, N, K] array in place gives the sliced layer's bits."""
    assert len({c.block_k for c in MATMUL_CLASSES}) > 1, "the classes should cover different K tiles"
    x, r = np.asarray(randn(1, (300, 256), BF16)), np.asarray(randn(3, (300, 128), BF16))
    ws = np.asarray(randn(2, (3, 128, 256), BF16, 0.1))
    ref = np.asarray(_matmul(x, ws[1], r, TABLE.matmul, INTERPRET))
    for c in MATMUL_CLASSES:
        for lo, hi in [(0, 1), (5, 21), (0, 300)]:
            assert_bits_equal(_matmul(x[lo:hi], ws[1], r[lo:hi], c, INTERPRET), ref[lo:hi], f"{c} rows {lo}:{hi}")
            assert_bits_equal(
                _product(x[lo:hi], ws, c, INTERPRET, layer=np.int32(1), residual=r[lo:hi]), ref[lo:hi], f"{c} stacked"
            )


# The default run checks the fused projections (the sampler's) against the separate ones (the
# learner's) through the model: tests/test_contract.py.
@pytest.mark.slow
def test_matmul_fused_projections_agree():
    """The sampler computes q/k/v (and gate/up) in one launch; the learner calls each projection
    on its own. Every output column must have the separate call's bits, for every tile class
    (including a width the fused kernel hands back to separate calls)."""
    x = randn(1, (20, 256), BF16)
    for widths in ((256, 64, 64), (96, 40)):
        ws = [np.asarray(randn(2 + i, (3, n, 256), BF16, 0.1)) for i, n in enumerate(widths)]
        for c in (numerics.MATMUL_DECODE, numerics.MATMUL):
            fused = _fused_product(x, ws, np.int32(2), c, INTERPRET)
            for w, y in zip(ws, fused, strict=True):
                assert_bits_equal(y, _matmul(x, w[2], None, numerics.MATMUL, INTERPRET), f"{c} {widths}")


@pytest.mark.parametrize("d,rope", [slow(64, False), slow(64, True), slow(40, False), (40, True)])
def test_rmsnorm_layer_reads_the_stack_in_place(d, rope):
    """rmsnorm_layer (the sampler: weights read out of the [L, D] stack) == rmsnorm on the sliced
    weight (the learner), bit for bit, also for widths the kernel pads."""
    n = 19
    x, ws = randn(1, (n, d), BF16, 3.0), (1 + np.asarray(randn(2, (3, d), F32, 0.1))).astype(BF16)
    ang = np.asarray(randn(3, (n, d // 2)))
    cos, sin = (np.cos(ang), np.sin(ang)) if rope else (None, None)
    c = numerics.rmsnorm_config(cos)
    got = jax.jit(rmsnorm.rmsnorm_layer, static_argnums=(5, 6, 7))(x, ws, np.int32(1), cos, sin, 1e-6, c, INTERPRET)
    want = jax.jit(rmsnorm.rmsnorm, static_argnums=(4, 5, 6))(x, ws[1], cos, sin, 1e-6, c, INTERPRET)
    assert_bits_equal(got, want, f"d={d} rope={rope}")


@pytest.mark.parametrize(
    "kv_split,t,block_pages",
    [(16, 37, 1), slow(32, 70, 2), slow(64, 150, 4), slow(128, 100, 4)]
    + ([] if INTERPRET else [(numerics.ATTENTION.kv_split, 600, numerics.ATTENTION.block_pages)]),
)
def test_attention_kv_splits(kv_split, t, block_pages):
    """Keys cut into fixed absolute splits of blocks of `block_pages` pages, merged in order: values
    match dense attention, and a prefill in two chunks followed by token-by-token decode (each call
    its own query tile and split count; a decode token's block holds pages nobody wrote yet) gives
    the whole pass's bits. Guards the sampler == learner contract past one split and one block."""
    import dataclasses

    config = dataclasses.replace(numerics.ATTENTION, kv_split=kv_split, block_pages=block_pages)
    q, k, v, pages, pt, pos = _attention_case(BF16, t=t, lens=(t, t // 2, 1))
    run = lambda sl, kp, vp: _attend(q[:, sl], k[:, sl], v[:, sl], kp, vp, np.int32(1), pt, pos[:, sl], config)  # noqa: E731
    check_against_truth(
        lambda q, k, v: _attend(q, k, v, pages, pages, np.int32(1), pt, pos, config)[0],
        lambda q, k, v: attention.dense_attention(q, k, v, pos),
        [q, k, v],
        "split attention vs dense",
    )
    whole, _, _ = run(slice(None), pages, pages)
    a, kp, vp = run(slice(0, t // 3), pages, pages)
    b, kp, vp = run(slice(t // 3, t - 3), kp, vp)
    outs = [a, b]
    for i in range(t - 3, t):
        o, kp, vp = run(slice(i, i + 1), kp, vp)
        outs.append(o)
    assert_bits_equal(np.concatenate(outs, axis=1), whole, f"kv_split {kv_split}: chunked prefill + decode vs whole")


@functools.partial(jax.jit, static_argnames="config")
def _attend_with_lse(q, k, v, kp, vp, pt, pos, config):
    """The strict attention's (out, log-sum-exp, k_pages): the lse is what the learner's backward reads."""
    plan = attention.plan(pt, pos, q.shape[2] // k.shape[2], config.page_size, config)
    out, lse, (kp, _) = attention._forward(q, k, v, (kp, vp), np.int32(0), plan, config, INTERPRET)
    return out, lse, kp


@pytest.mark.slow  # the default run's merges: test_attention_kv_splits[16-37-1], test_attention_row_alone_...
def test_attention_merge_launch_keeps_bits():
    """The merge kernel's launch choices (AttentionConfig.merge_prefetch, merge_block_d,
    merge_warps) change no bit: split states loaded ahead in the loop's carry and head-dim column
    blocks per program give the out and log-sum-exp of one split a step over whole rows. 5 KV splits
    (fewer than the default prefetch of 8, more than a prefetch of 2), rows of 37, 18 and 1 keys;
    compiled on a GPU at Qwen3-8B heads and a 2,000-key context (32 splits of 64). Prevents: a
    prefetched state merged twice, a slot past the last split merged, a column block that writes
    another block's columns or a wrong log-sum-exp."""
    if INTERPRET:
        case, split = dict(t=37, dh=32, lens=(37, 18, 1)), dict(kv_split=16, block_pages=1)
    else:
        case, split = dict(t=2000, hq=32, hkv=8, dh=128, lens=(2000, 1000, 1)), dict(kv_split=64)
    q, k, v, pages, pt, pos = _attention_case(BF16, **case)
    base = dataclasses.replace(numerics.ATTENTION, **split, merge_in_kernel_from=2**30)
    one_split_a_step = dataclasses.replace(base, merge_prefetch=1, merge_block_d=q.shape[3], merge_warps=2)
    want = _attend_with_lse(q, k, v, pages, pages, pt, pos, one_split_a_step)[:2]
    for prefetch, block_d, warps in [(base.merge_prefetch, 16, base.merge_warps), (2, 16, 8)]:
        c = dataclasses.replace(base, merge_prefetch=prefetch, merge_block_d=block_d, merge_warps=warps)
        got = _attend_with_lse(q, k, v, pages, pages, pt, pos, c)[:2]
        for g, w, name in zip(got, want, ("out", "lse")):
            seen = np.asarray(pos >= 0)  # padding tokens' rows are not outputs of anything
            assert_bits_equal(
                np.asarray(g)[seen], np.asarray(w)[seen], f"{name}: prefetch {prefetch}, {block_d} columns"
            )


def test_attention_row_alone_equals_batched_across_splits():
    """A row's attention bits do not depend on its batch or its neighbours' lengths, past several KV
    splits: each row attended alone (batch 1, its keys on other physical pages) equals its row in a
    batch of rows of 37, 20 and 1 keys, for the whole pass and for its last token decoded after a
    prefill of the others. 16-key splits of 16-key blocks (3 splits for the longest row), merged in
    the attention kernel from 2 query tiles: the whole passes merge there (the learner's way), a
    decode token in the merge kernel (the sampler's)."""
    config = dataclasses.replace(numerics.ATTENTION, kv_split=16, block_pages=1, merge_in_kernel_from=2)
    q, k, v, pages, pt, pos = _attention_case(BF16)

    def attend(sl, kp, vp, table):
        return _attend(q[sl], k[sl], v[sl], kp, vp, np.int32(0), table, pos[sl], config)

    batched, _, _ = attend((slice(None), slice(None)), pages, pages, pt)
    for row, n in enumerate((pos >= 0).sum(axis=1)):
        table = pt[row : row + 1, ::-1] + 0  # the same logical pages on other physical pages
        whole, _, _ = attend((slice(row, row + 1), slice(None)), pages, pages, table)
        assert_bits_equal(np.asarray(whole)[0, :n], np.asarray(batched)[row, :n], f"row {row} alone, whole pass")
        kp = vp = pages
        if n > 1:
            _, kp, vp = attend((slice(row, row + 1), slice(0, n - 1)), pages, pages, table)
        token, _, _ = attend((slice(row, row + 1), slice(n - 1, n)), kp, vp, table)
        assert_bits_equal(np.asarray(token)[0, 0], np.asarray(batched)[row, n - 1], f"row {row} alone, decode")


@pytest.mark.slow  # 300 tokens through the interpreted gradient; the default run audits it in test_hlo_audit.py
def test_embedding_gradient_sums_repeated_tokens_in_fp32():
    """embedding.embed: the forward is plain indexing (same bits); the gradient of a row is its tokens'
    cotangents summed in fp32 and rounded once to bf16. Truth is the float64 sum rounded to bf16;
    the fp32 sum of n <= 64 terms is within n * 2^-24 * sum|terms| of it (far below bf16's half ulp,
    2^-9 relative), so every row must be the rounded truth or, where the truth sits that close to a
    rounding boundary, the bf16 neighbour on the fp32 sum's side: at most one bf16 ulp off."""
    from rlkjax.core import embedding

    vocab, d, n = 50, 32, 300
    table = np.asarray(randn(0, (vocab, d), BF16))
    ids = np.array(host_ints(1, (n,), 8))  # many repeats, and a few other rows
    ids[::7] = np.asarray(host_ints(2, (43,), vocab))
    ct = randn(3, (n, d), BF16)
    assert_bits_equal(jax.jit(embedding.embed)(table, ids), table[ids], "embed forward")
    (grad,) = jax.jit(lambda t, ids, ct: jax.vjp(lambda t: embedding.embed(t, ids), t)[1](ct))(table, ids, ct)
    truth = np.zeros((vocab, d))
    np.add.at(truth, ids, np.asarray(ct, np.float64))
    rounded = truth.astype(np.float32).astype(BF16)  # float64 -> float32 -> bf16, each to nearest even
    ulp = np.abs(np.nextafter(rounded, np.asarray(np.inf, BF16)).astype(np.float64) - rounded.astype(np.float64))
    rounded = rounded.astype(np.float64)
    off = np.abs(np.asarray(grad, np.float64) - rounded)
    assert grad.dtype == BF16 and (off <= ulp).all()
    assert (off == 0).mean() > 0.99  # nearly all exactly the rounded truth
    unused = np.setdiff1d(np.arange(vocab), np.asarray(ids))
    assert (np.asarray(grad, np.float64)[unused] == 0).all()


@pytest.mark.parametrize(
    "hq,hkv,dh,block,dq",
    [(4, 2, 16, 16, (0, 0)), slow(6, 2, 24, 32, (0, 0)), slow(5, 1, 8, 16, (0, 0)), slow(4, 2, 16, 16, (32, 16))],
)
def test_attention_flash_backward(hq, hkv, dh, block, dq):
    """The Pallas backward (AttentionConfig.backward): dq, dk, dv as close to the float64 dense truth
    as XLA's dense backward is (check_grads: within twice the reference's own error), the same
    bits twice; padding rows and rows whose keys span several blocks, group sizes 2 / 3 / 5, head
    dims 16 / 24 (padded to 32) / 8 (padded to 16), and dq blocks other than dkdv's (32 queries by
    16 keys, the sequence padded to the larger)."""
    import dataclasses

    from pallas_kernels.attention_bwd import AttentionBwdConfig

    bwd = AttentionBwdConfig(block_q=block, block_k=block, dq_block_q=dq[0], dq_block_k=dq[1])
    config = dataclasses.replace(numerics.ATTENTION, backward=bwd)
    q, k, v, pages, pt, pos = _attention_case(F32, hq=hq, hkv=hkv, dh=dh)
    ker = lambda q, k, v: _attend(q, k, v, pages, pages, np.int32(1), pt, pos, config)[0]  # noqa: E731
    check_grads(ker, lambda q, k, v: attention.dense_attention(q, k, v, pos), [q, k, v], (0, 1, 2), "flash bwd")
    # Skipping the block pairs that see nothing changes no bit (they would add exact zeros).
    no_skip = dataclasses.replace(config, backward=dataclasses.replace(config.backward, skip_blocks=False))
    cot = np.asarray(randn(9, q.shape))

    def grads_with(c):
        loss = lambda q, k, v: jnp.sum(_attend(q, k, v, pages, pages, np.int32(1), pt, pos, c)[0] * cot)  # noqa: E731
        return jax.grad(loss, (0, 1, 2))(q, k, v)

    grads = [grads_with(config), grads_with(no_skip)]
    for a, b, name in zip(*grads, "qkv"):
        assert_bits_equal(a, b, f"d{name}: skipped blocks vs all blocks")


@pytest.mark.slow  # a GPU launch choice (compiled, at Qwen3-4B heads); interpreted: a check of the layout
@pytest.mark.parametrize("rows,warps", [(64, 4), (128, 4), (128, 8), (32, 2)])
def test_attention_long_rows_agree(rows, warps):
    """With row_sums "product" (numerics.ATTENTION_LONG_ROWS) the learner's rows and long prefill
    chunks run `long_rows`-row query tiles where a decode step runs 16 rows on 2 warps: every row
    gets the 16-row tiles' bits, because each reduction over a row's keys is a product (p @ v,
    p @ ones), whose chain does not follow the tile's height, and the row max is exact in any order.
    Rows of 1024, 517 and 1 tokens (several KV splits, padding rows in a tile, a tile that sees
    nothing past its row's end), compiled at Qwen3-4B heads. With "reduce" the config refuses long
    rows, which would change the bits."""
    with pytest.raises(ValueError, match="row_sums='product'"):
        dataclasses.replace(numerics.ATTENTION, long_rows=64)
    if INTERPRET:
        case, config = dict(t=128, lens=(128, 61, 1)), dataclasses.replace(numerics.ATTENTION_LONG_ROWS, kv_split=64)
    else:
        case, config = dict(t=1024, hq=32, hkv=8, dh=128, lens=(1024, 517, 1)), numerics.ATTENTION_LONG_ROWS
    q, k, v, pages, pt, pos = _attention_case(BF16, **case)
    decode_tiles = dataclasses.replace(config, long_rows=config.block_rows, long_warps=config.num_warps)
    ref, _, _ = _attend(q, k, v, pages, pages, np.int32(1), pt, pos, decode_tiles)
    other = dataclasses.replace(config, long_rows=rows, long_warps=warps)
    got, _, _ = _attend(q, k, v, pages, pages, np.int32(1), pt, pos, other)
    assert_bits_equal(got, ref, f"{rows}-row tiles on {warps} warps vs {config.block_rows} on {config.num_warps}")


@pytest.mark.slow  # tiles and warps are GPU launch choices (compiled, at Qwen3-4B heads); interpreted: 45 s
@pytest.mark.parametrize("tiles,warps", [(2, 4), (4, 4), (8, 4), (1, 2), (2, 2), (1, 8)])
def test_attention_tiles_per_program_agree(tiles, warps):
    """Query tiles sharing each KV block load in one program (AttentionConfig.tiles) and the warp
    count give every row the bits of one tile per program on 4 warps: each tile runs the same
    arithmetic on its own rows, a block it does not see is an exact no-op for it, and the warps
    only change which threads do the work (measured on the H200: so for 2-8 warps, not for 1).
    Padding rows, several KV splits, rows of different lengths; compiled on a GPU at Qwen3-4B head
    shapes. The cache is compared without its trash page 0, which every padding token writes."""
    if INTERPRET:
        case, config = dict(t=128, lens=(128, 61, 1)), dataclasses.replace(numerics.ATTENTION, kv_split=64)
    else:
        case, config = dict(t=1024, hq=32, hkv=8, dh=128, lens=(1024, 517, 1)), numerics.ATTENTION
    q, k, v, pages, pt, pos = _attention_case(BF16, **case)
    one = dataclasses.replace(config, tiles=1, num_warps=4)
    ref, kp, _ = _attend(q, k, v, pages, pages, np.int32(1), pt, pos, one)
    other = dataclasses.replace(one, tiles=tiles, num_warps=warps)
    got, kp2, _ = _attend(q, k, v, pages, pages, np.int32(1), pt, pos, other)
    assert_bits_equal(got, ref, f"{tiles} tiles per program on {warps} warps vs 1 on 4")
    assert_bits_equal(kp2[:, :, 1:], kp[:, :, 1:], "cache written")
