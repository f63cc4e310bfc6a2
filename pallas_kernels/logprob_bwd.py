"""The backward of pallas_kernels.logprob's token logprobs: d logp / d h and d logp / d w, streamed over
vocabulary chunks with the forward's saved log-sum-exp, so no [N, V] array ever exists. Per chunk one
kernel recomputes the logits with the matmul's tile code and turns them into dz (`_dz`); the two gradient
products run in the matmul kernels. Fixed chunk order: the same bits on every run.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _math, matmul
from pallas_kernels.common import F32, compiler_params, greedy_and_temperature, pad_dim

BWD_CHUNK_BYTES = 1 << 29  # the backward's [N, chunk] tile, counted at 4 bytes an entry: 512 MiB at most
# Interpreted (the CPU), every grid step of a Pallas kernel copies the kernel's whole output, so a
# chunk's cost grows with its steps times its size: narrow chunks there, of a fixed width, which also
# makes the CPU's gradient bits independent of the row count.
INTERPRET_CHUNK_IDS = 2048


def vocab_chunk(rows, vocab, step, interpret=False):
    """Vocab ids per backward step: as wide as BWD_CHUNK_BYTES allows (each step is a
    [rows, chunk] GEMM, too small a one when narrow), at most
    INTERPRET_CHUNK_IDS interpreted, a multiple of `step` (whole vocab tiles and whole output tiles
    of the dz kernel), at most the (padded) vocab."""
    fit = max(step, (BWD_CHUNK_BYTES // (4 * max(rows, 1))) // step * step)
    if interpret:
        fit = min(fit, max(step, INTERPRET_CHUNK_IDS // step * step))
    return min(fit, -(-vocab // step) * step)


def _dz_kernel(v0_ref, h_ref, w_ref, inv_t_ref, lse_ref, tgt_ref, g_ref, o_ref, *, block_k, k_steps, vocab, interpret):
    """One [rows, ids] tile of dz = g / T * (onehot - softmax(logits / T)): the logits from the
    matmul's own tile code (`matmul.accumulate`, fp32 accumulator, K ascending), the rest in the
    epilogue, so the fp32 logits are never written out and read back."""
    block_n = o_ref.shape[1]
    z = matmul.accumulate(lambda ks: h_ref[:, ks], lambda ks: w_ref[:, ks], o_ref.shape, block_k, k_steps, interpret)
    inv_t = inv_t_ref[...]
    z = z * inv_t[:, None]
    ids = v0_ref[0] + pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)[None, :]
    p = jnp.where(ids < vocab, _math.exp(z - lse_ref[...][:, None]), 0.0)
    onehot = (ids == tgt_ref[...][:, None]).astype(F32)
    o_ref[...] = ((g_ref[...] * inv_t)[:, None] * (onehot - p)).astype(o_ref.dtype)


def _dz(h, w_tile, v0, per_row, vocab, config: matmul.MatmulConfig, interpret: bool):
    """dz [N, chunk] in h.dtype for the vocab ids v0 .. v0 + chunk (w_tile [chunk, D], chunk a
    multiple of block_n). per_row: (1 / T, log-sum-exp, target, cotangent g) [N] each. Padded rows
    get g = 0: their dz is 0 (and sliced away)."""
    inv_t, lse, targets, g = per_row
    c = config
    n = h.shape[0]
    h = pad_dim(pad_dim(h, 0, c.block_m), 1, c.block_k)
    w_tile = pad_dim(w_tile, 1, c.block_k)
    mp, kp = h.shape
    rows = [pad_dim(a, 0, c.block_m) for a in (inv_t, lse, targets.astype(jnp.int32), g)]
    row = pl.BlockSpec((c.block_m,), lambda i, j: (i,))
    out = pl.pallas_call(
        functools.partial(_dz_kernel, block_k=c.block_k, k_steps=kp // c.block_k, vocab=vocab, interpret=interpret),
        name=f"logprob_dz_n{w_tile.shape[0]}_k{kp}",
        grid=(mp // c.block_m, w_tile.shape[0] // c.block_n),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (0,)),
            pl.BlockSpec((c.block_m, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((c.block_n, kp), lambda i, j: (j, 0)),
            row,
            row,
            row,
            row,
        ],
        out_specs=pl.BlockSpec((c.block_m, c.block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, w_tile.shape[0]), h.dtype),
        compiler_params=compiler_params(c.num_warps, c.num_stages),
        interpret=interpret,
    )(jnp.reshape(v0, (1,)).astype(jnp.int32), h, w_tile, *rows)
    return out[:n]


def backward(config, interpret, saved, g):
    """d logp / d logits_v = (onehot_v - p_v) / T, streamed over vocab chunks with the saved
    log-sum-exp, so the backward never holds [N, V] either. Fixed chunk order; per chunk, one
    kernel recomputes the logits from bf16 operands with fp32 accumulation (as the forward kernel
    does) and turns them into dz, rounded to the model dtype (`_dz`); the two gradient products
    (fp32 accumulation) run in our matmul kernels (`config.backward`; with its backward_in_place
    they read dz, w and h where they lie instead of transposed copies)."""
    h, w, targets, temperature, lse = saved
    vocab = w.shape[0]
    chunk = vocab_chunk(h.shape[0], vocab, max(config.block_vocab, config.backward.block_n), interpret)
    wc = pad_dim(w, 0, chunk).reshape(-1, chunk, w.shape[1])  # an odd vocab: padded ids masked in _dz
    inv_t = 1.0 / greedy_and_temperature(temperature.astype(F32))[1]  # a greedy row was scored at T = 1
    dot = functools.partial(matmul.product, config=config.backward, interpret=interpret)
    if config.backward.backward_in_place:  # no transposed copies of dz, w and h
        d_h = lambda dz, w_tile: dot(dz, w_tile, layout="nn", out_dtype=F32)  # noqa: E731
        d_w = lambda dz: dot(dz, h, layout="tn")  # noqa: E731
    else:
        h_t = h.T
        d_h = lambda dz, w_tile: dot(dz, w_tile.T, out_dtype=F32)  # noqa: E731
        d_w = lambda dz: dot(dz.T, h_t)  # noqa: E731

    def step(dh, xs):
        w_tile, v0 = xs
        dz = _dz(h, w_tile, v0, (inv_t, lse, targets, g.astype(F32)), vocab, config.backward, interpret)
        return dh + d_h(dz, w_tile), d_w(dz).astype(w.dtype)

    dh, dw = jax.lax.scan(step, jnp.zeros(h.shape, F32), (wc, jnp.arange(wc.shape[0]) * chunk))
    return dh.astype(h.dtype), dw.reshape(-1, w.shape[1])[:vocab], None, None
