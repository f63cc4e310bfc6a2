"""Truncated sampling (top_k, top_p, min_p) over a few rows' materialised fp32 logits / T.

The kept set of a row, each filter applied to what the previous one kept (HF's and vLLM's order):
  top_k (V: off): ids whose logit >= the k-th largest logit (equal logits at the boundary all stay);
  top_p (1: off): in descending order of logit, an id stays while the probability mass of the kept
      ids before it, summed in a fixed order, is < top_p * their total mass (the most likely id
      always stays; ids with the logit of the last one kept stay too);
  min_p (0: off): exp(logit - max logit) >= min_p, i.e. p >= min_p * p_max (renormalising does not
      change that ratio, so the order does not matter for it).
The draw is Gumbel-max over the kept ids with the untruncated sampler's noise (greedy rows: plain
argmax), so it samples the renormalised distribution, and with nothing truncated it draws the
untruncated token (the logits come from the fused kernel's tile code: tested). `truncate` gives
per row the drawn token and its logprob under the renormalised kept set (logit - log-sum-exp of the
kept logits), and a target's; `logprob.head` adds the full distribution's logprob from its fused
kernel (the learner's bits by construction). Scoring targets runs the same kernels and gives the
sampler's bits for the same row (rows never mix).

Float arithmetic (exp, sums, the cumulative mass, log) runs in the two kernels below, over vocab
tiles in ascending order; XLA only sorts (top_k over the whole vocabulary: selection) and gathers.
This materialises [rows, vocab] fp32: a variant for the rows of a decode step that ask for it.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _math
from pallas_kernels.common import F32, compiler_params, pad_dim


def _top_p_kernel(sorted_ref, thr_k_ref, top_p_ref, count_ref, *, block_vocab, num_tiles):
    """How many of a row's logits (sorted descending) top_k and top_p keep."""
    rows = sorted_ref.shape[0]
    thr_k, top_p = thr_k_ref[...], top_p_ref[...]
    zmax = jnp.max(sorted_ref[:, pl.ds(0, block_vocab)], axis=1)  # the row's largest logit

    def tile(vi):
        z = sorted_ref[:, pl.ds(pl.multiple_of(vi * block_vocab, block_vocab), block_vocab)]
        in_k = z >= thr_k[:, None]
        return in_k, jnp.where(in_k, _math.exp(z - zmax[:, None]), 0.0)

    total = jax.lax.fori_loop(0, num_tiles, lambda vi, t: t + jnp.sum(tile(vi)[1], axis=1), jnp.zeros((rows,), F32))
    cut = top_p * total

    def count(vi, carry):
        before, n = carry
        in_k, p = tile(vi)
        mass_before = before[:, None] + (jnp.cumsum(p, axis=1) - p)  # of the ids ahead of each one
        kept = in_k & ((top_p[:, None] >= 1.0) | (mass_before < cut[:, None]))
        return before + jnp.sum(p, axis=1), n + jnp.sum(kept.astype(jnp.int32), axis=1)

    init = (jnp.zeros((rows,), F32), jnp.zeros((rows,), jnp.int32))
    count_ref[...] = jax.lax.fori_loop(0, num_tiles, count, init)[1]


def _sample_kernel(z_ref, row_refs, tok_ref, renorm_ref, tgt_renorm_ref, *, block_vocab, num_tiles, vocab):
    """Gumbel-max over the kept ids and the kept set's log-sum-exp, vocab tiles ascending; the
    drawn token's and the target's renormalised logprobs (-inf for a target outside the set).
    row_refs: per row, the kept set's threshold, the largest logit, min_p, key, temperature, target."""
    thr_ref, max_ref, min_p_ref, key_ref, temp_ref, tgt_ref = row_refs
    rows = z_ref.shape[0]
    thr, zmax, min_p, key, tgt = thr_ref[...], max_ref[...], min_p_ref[...], key_ref[...], tgt_ref[...]
    greedy = temp_ref[...] == 0.0

    def body(vi, carry):
        m, s, best_score, best_tok, best_logit, tgt_logit = carry
        v0 = pl.multiple_of(vi * block_vocab, block_vocab)
        z = z_ref[:, pl.ds(v0, block_vocab)]
        cols = v0 + jnp.arange(block_vocab, dtype=jnp.int32)[None, :]
        kept = (cols < vocab) & (z >= thr[:, None]) & (_math.exp(z - zmax[:, None]) >= min_p[:, None])
        zk = jnp.where(kept, z, -jnp.inf)
        # Running log-sum-exp of the kept logits; a tile with none kept adds exact zeros.
        m_new = jnp.maximum(m, jnp.max(zk, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        s = s * _math.exp(m - shift) + jnp.sum(_math.exp(zk - shift[:, None]), axis=1)
        # Gumbel-max over the kept ids, as logprob's sampler draws: ties to the lowest id.
        tile_best, tile_tok, tile_logit = _math.gumbel_max_tile(zk, z, cols, key, greedy)
        better = tile_best > best_score
        return (
            m_new,
            s,
            jnp.where(better, tile_best, best_score),
            jnp.where(better, tile_tok, best_tok),
            jnp.where(better, tile_logit, best_logit),
            jnp.maximum(tgt_logit, jnp.max(jnp.where(cols == tgt[:, None], zk, -jnp.inf), axis=1)),
        )

    neg = jnp.full((rows,), -jnp.inf, F32)
    init = (neg, jnp.zeros((rows,), F32), neg, jnp.zeros((rows,), jnp.int32), neg, neg)
    m, s, _, tok, logit, tgt_logit = jax.lax.fori_loop(0, num_tiles, body, init)
    lse_kept = m + _math.log(s)
    tok_ref[...] = tok
    renorm_ref[...] = logit - lse_kept
    tgt_renorm_ref[...] = tgt_logit - lse_kept


def truncate(z, targets, keys, temperature, truncation, config, interpret: bool):
    """z [N, V]: the rows' fp32 logits / T (logprob.head's `_logits`); truncation: (top_k, top_p,
    min_p) [N] each. Returns the drawn tokens and their renormalised logprobs, the targets'
    renormalised logprobs [N], and the logits sorted descending with their ids [N, V]. config: the
    head's LogprobConfig (row and vocab tiles)."""
    top_k, top_p, min_p = truncation
    n, vocab = z.shape
    c = config
    values, ids = jax.lax.top_k(z, vocab)  # a full sort, descending (selection: no rounding)
    thr_k = jnp.take_along_axis(values, (top_k - 1)[:, None], axis=1)[:, 0]
    br, bv = c.block_rows, c.block_vocab
    rows_p = pl.cdiv(n, br) * br
    padded = pad_dim(pad_dim(values, 1, bv, value=-jnp.inf), 0, br)
    row = pl.BlockSpec((br,), lambda i: (i,))
    num_tiles = padded.shape[1] // bv
    count = pl.pallas_call(
        functools.partial(_top_p_kernel, block_vocab=bv, num_tiles=num_tiles),
        grid=(rows_p // br,),
        in_specs=[pl.BlockSpec((br, padded.shape[1]), lambda i: (i, 0)), row, row],
        out_specs=row,
        out_shape=jax.ShapeDtypeStruct((rows_p,), jnp.int32),
        compiler_params=compiler_params(c.num_warps, 1),
        interpret=interpret,
    )(padded, pad_dim(thr_k, 0, br), pad_dim(top_p.astype(F32), 0, br, value=1.0))[:n]
    thr = jnp.take_along_axis(values, (count - 1)[:, None], axis=1)[:, 0]
    zp = pad_dim(pad_dim(z, 1, bv, value=-jnp.inf), 0, br)
    per_row = [pad_dim(a, 0, br) for a in (thr, values[:, 0], min_p.astype(F32), keys)]
    per_row.append(pad_dim(temperature.astype(F32), 0, br, value=1.0))  # padding rows: finite, not greedy
    per_row.append(pad_dim(targets.astype(jnp.int32), 0, br))
    tok, renorm, tgt_renorm = pl.pallas_call(
        functools.partial(_sample_kernel, block_vocab=bv, num_tiles=num_tiles, vocab=vocab),
        grid=(rows_p // br,),
        in_specs=[pl.BlockSpec((br, zp.shape[1]), lambda i: (i, 0)), [row] * len(per_row)],
        out_specs=[row] * 3,
        out_shape=[jax.ShapeDtypeStruct((rows_p,), t) for t in (jnp.int32, F32, F32)],
        compiler_params=compiler_params(c.num_warps, 1),
        interpret=interpret,
    )(zp, per_row)
    return tok[:n], renorm[:n], tgt_renorm[:n], values, ids


def truncate_reference(z, top_k, top_p, min_p):
    """The same rules in plain XLA over logits z [N, V]: (z, its log-sum-exp, the kept set's, the kept
    logits (-inf elsewhere), the sorted values and their ids)."""
    vocab = z.shape[1]
    values, ids = jax.lax.top_k(z, vocab)
    thr_k = jnp.take_along_axis(values, (top_k - 1)[:, None], axis=1)
    in_k = values >= thr_k
    p = jnp.where(in_k, jnp.exp(values - values[:, :1]), 0.0)
    kept = in_k & ((top_p[:, None] >= 1.0) | (jnp.cumsum(p, axis=1) - p < top_p[:, None] * p.sum(1, keepdims=True)))
    thr = jnp.take_along_axis(values, kept.sum(1, keepdims=True) - 1, axis=1)
    kept = (z >= thr) & (jnp.exp(z - values[:, :1]) >= min_p[:, None])
    zk = jnp.where(kept, z, -jnp.inf)
    return z, jax.nn.logsumexp(z, axis=1), jax.nn.logsumexp(zk, axis=1), zk, values, ids
