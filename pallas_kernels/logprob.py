"""Fused token log-probability: lm_head projection + fp32 log-softmax over fixed vocabulary tiles +
gather of the target token (or a Gumbel-max sample), with temperature.

h [N, D] (final-normed hidden states), w [V, D] (lm_head / tied embedding, HF layout),
temperature [N] fp32. Per row and vocab tile of `block_vocab` ids, logits = (h @ w_tile.T) / T with
an fp32 accumulator walking D in ascending `block_k` steps. The vocabulary's tiles are cut into
`vocab_splits` fixed ranges (so a decode step of a few rows still spreads over the GPU); each
program walks its range's tiles in ascending order with a running fp32 max and sum, and a second
kernel merges the ranges in ascending order. The ranges depend on V and the config only, never on
the batch. No [N, V] logits array ever exists.

The sampler and the learner run this same kernel (one body computes the log-sum-exp, the target's
logit and the Gumbel-max sample every time), so the logit of a drawn token and its log-sum-exp are
the same bits whether the row was sampled or scored. The sample draws from softmax(logits / T):
argmax(logits / T + Gumbel noise), the noise a hash of (seed, step, vocab id).

Temperature 0 is greedy: the kernel divides by 1 and adds no noise, so the drawn token is the argmax
of the logits (ties to the lowest id) and its logprob is the temperature-1 one; scoring at T = 0 is
scoring at T = 1, so `score(..., temperature=1)` gives the same bits.

`head` is the one entry, for both sides: score targets or draw keyed by (seed, step), with top
top logprobs and truncation (pallas_kernels.truncation) as options. Those options need a row's
materialised logits: `_logits_kernel` writes the fp32 logits / T of every vocab tile with the fused
kernel's own tile code, XLA's top_k selects (no rounding), and `_minus_kernel` subtracts the fused
kernel's log-sum-exp, the one rounding a logprob has (logit - lse, as in `_merge_kernel`). That is
[rows, vocab] fp32, so only the rows that ask run it. `head_reference` is the same signature in
plain XLA (`numerics="fast"`).
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _math, logprob_bwd, matmul
from pallas_kernels.common import (
    F32,
    acc_dtype,
    check_block,
    compiler_params,
    dot_nt,
    greedy_and_temperature,
    pad_dim,
)
from pallas_kernels.truncation import truncate, truncate_reference


@dataclasses.dataclass(frozen=True)
class LogprobConfig:
    block_rows: int = 16
    block_vocab: int = 128
    block_k: int = 64
    vocab_splits: int = 128
    num_warps: int = 4
    num_stages: int = 2
    # the backward's three products per vocab chunk (logits again, dh, dw): our matmul kernel, not
    # XLA dots, whose algorithm XLA's autotuner picks per compilation (bits could change run to run)
    backward: matmul.MatmulConfig = matmul.MatmulConfig(block_m=128, block_n=256, block_k=64, num_warps=8)

    def __post_init__(self):
        check_block("block_rows", self.block_rows)
        check_block("block_vocab", self.block_vocab)
        check_block("block_k", self.block_k)
        check_block("vocab_splits", self.vocab_splits, minimum=1)


def _tile_logits(h_ref, w_ref, v0, temp, *, block_vocab, block_k, k_steps):
    def body(ki, acc):
        ks = pl.ds(pl.multiple_of(ki * block_k, block_k), block_k)
        return acc + dot_nt(h_ref[:, ks], w_ref[pl.ds(v0, block_vocab), ks])

    acc = jax.lax.fori_loop(0, k_steps, body, jnp.zeros((h_ref.shape[0], block_vocab), F32))
    return acc / temp[:, None]


def _split_kernel(
    h_ref,
    w_ref,
    tgt_ref,
    temp_ref,
    key_ref,
    part_refs,
    *,
    block_vocab,
    block_k,
    k_steps,
    tiles_per_split,
    num_tiles,
    vocab,
):
    rows = h_ref.shape[0]
    tgt, key = tgt_ref[...], key_ref[...]
    greedy, temp = greedy_and_temperature(temp_ref[...])
    first = pl.program_id(1) * tiles_per_split

    def body(vi, carry):
        m, s, tgt_logit, best_score, best_tok, best_logit = carry
        v0 = pl.multiple_of(vi * block_vocab, block_vocab)
        logits = _tile_logits(h_ref, w_ref, v0, temp, block_vocab=block_vocab, block_k=block_k, k_steps=k_steps)
        cols = v0 + jnp.arange(block_vocab, dtype=jnp.int32)[None, :]
        if vocab is not None:  # a padded vocab: its padded ids are never counted, matched or drawn
            logits = jnp.where(cols < vocab, logits, -jnp.inf)
        # Running log-sum-exp, tiles in ascending order.
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        s = s * _math.exp(m - m_new) + jnp.sum(_math.exp(logits - m_new[:, None]), axis=1)
        # Target logit: one id matches, so a max over a -inf background is an exact gather.
        tgt_logit = jnp.maximum(tgt_logit, jnp.max(jnp.where(cols == tgt[:, None], logits, -jnp.inf), axis=1))
        # Gumbel-max sample (greedy rows: plain argmax); ties go to the lowest id (strict > across
        # tiles, min id within one).
        tile_best, tile_tok, tile_logit = _math.gumbel_max_tile(logits, logits, cols, key, greedy)
        better = tile_best > best_score
        return (
            m_new,
            s,
            tgt_logit,
            jnp.where(better, tile_best, best_score),
            jnp.where(better, tile_tok, best_tok),
            jnp.where(better, tile_logit, best_logit),
        )

    neg = jnp.full((rows,), -jnp.inf, F32)
    init = (neg, jnp.zeros((rows,), F32), neg, neg, jnp.zeros((rows,), jnp.int32), neg)
    out = jax.lax.fori_loop(first, jnp.minimum(first + tiles_per_split, num_tiles), body, init)
    # part_refs: this vocab range's (max, sum, target logit, best score, best token, its logit) per row
    for ref, value in zip(part_refs, out):
        ref[...] = value


def _merge_kernel(part_refs, tgt_lp_ref, tok_ref, tok_lp_ref, lse_ref):
    """Merge the vocab ranges (`_split_kernel`'s parts) in ascending order. Empty ranges carry m = -inf,
    s = 0: no effect."""
    m_ref, s_ref, tgt_logit_ref, best_score_ref, best_tok_ref, best_logit_ref = part_refs
    splits = m_ref.shape[0]
    m = jax.lax.fori_loop(0, splits, lambda i, m: jnp.maximum(m, m_ref[i]), m_ref[0])
    s = jax.lax.fori_loop(0, splits, lambda i, s: s + s_ref[i] * _math.exp(m_ref[i] - m), jnp.zeros_like(m))
    tgt_logit = jax.lax.fori_loop(0, splits, lambda i, t: jnp.maximum(t, tgt_logit_ref[i]), tgt_logit_ref[0])

    def pick(i, carry):
        score, tok, logit = carry
        better = best_score_ref[i] > score
        return (
            jnp.where(better, best_score_ref[i], score),
            jnp.where(better, best_tok_ref[i], tok),
            jnp.where(better, best_logit_ref[i], logit),
        )

    _, tok, logit = jax.lax.fori_loop(1, splits, pick, (best_score_ref[0], best_tok_ref[0], best_logit_ref[0]))
    lse = m + _math.log(s)
    tgt_lp_ref[...] = tgt_logit - lse
    tok_ref[...] = tok
    tok_lp_ref[...] = logit - lse
    lse_ref[...] = lse


def _check(h, w, *rows):
    if h.ndim != 2 or w.ndim != 2 or h.shape[1] != w.shape[1]:
        raise ValueError(f"logprob shapes do not match: hidden {h.shape}, lm_head {w.shape}")
    for r in rows:
        if r.shape != (h.shape[0],):
            raise ValueError(f"per-row input of shape {r.shape} does not match {h.shape[0]} rows")


def _pad(h, w, temperature, config: LogprobConfig):
    """Odd shapes: D gets zero features (exact zero products) up to whole K steps, and the vocabulary
    zero rows up to whole tiles, whose ids the kernels mask to -inf. Rows are padded to whole row
    blocks; padding rows get temperature 1 so they stay finite (their outputs are sliced away).
    Tile multiples copy nothing. Returns h, w, temperature and the vocab to mask (None: no padding)."""
    c = config
    masked_vocab = w.shape[0] if w.shape[0] % c.block_vocab else None
    h, w = pad_dim(h, 1, c.block_k), pad_dim(pad_dim(w, 1, c.block_k), 0, c.block_vocab)
    h = pad_dim(h, 0, c.block_rows)
    return h, w, pad_dim(temperature.astype(F32), 0, c.block_rows, value=1.0), masked_vocab


def _fused(h, w, targets, temperature, keys, config: LogprobConfig, interpret: bool):
    """Returns (target_logprobs, sampled_tokens, sampled_logprobs, lse), each [N]."""
    n = h.shape[0]
    c = config
    h, w, temperature, masked_vocab = _pad(h, w, temperature, c)
    d = h.shape[1]
    br = c.block_rows
    targets, keys = pad_dim(targets.astype(jnp.int32), 0, br), pad_dim(keys, 0, br)
    rows_p = h.shape[0]
    num_tiles = w.shape[0] // c.block_vocab
    splits = min(c.vocab_splits, num_tiles)
    tiles_per_split = -(-num_tiles // splits)
    row = pl.BlockSpec((br,), lambda i, j: (i,))
    part = pl.BlockSpec((None, br), lambda i, j: (j, i))
    part_types = (F32, F32, F32, F32, jnp.int32, F32)
    (parts,) = pl.pallas_call(
        functools.partial(
            _split_kernel,
            block_vocab=c.block_vocab,
            block_k=c.block_k,
            k_steps=d // c.block_k,
            tiles_per_split=tiles_per_split,
            num_tiles=num_tiles,
            vocab=masked_vocab,
        ),
        name="logprob_split",
        grid=(rows_p // br, splits),
        in_specs=[
            pl.BlockSpec((br, d), lambda i, j: (i, 0)),
            pl.BlockSpec(w.shape, lambda i, j: (0, 0)),
            row,
            row,
            row,
        ],
        out_specs=[(part,) * 6],
        out_shape=[tuple(jax.ShapeDtypeStruct((splits, rows_p), t) for t in part_types)],
        compiler_params=compiler_params(c.num_warps, c.num_stages),
        interpret=interpret,
    )(h, w, targets, temperature, keys)
    merged_row = pl.BlockSpec((br,), lambda i: (i,))
    outs = pl.pallas_call(
        _merge_kernel,
        name="logprob_merge",
        grid=(rows_p // br,),
        in_specs=[(pl.BlockSpec((splits, br), lambda i: (0, i)),) * 6],
        out_specs=[merged_row] * 4,
        out_shape=[jax.ShapeDtypeStruct((rows_p,), t) for t in (F32, jnp.int32, F32, F32)],
        compiler_params=compiler_params(c.num_warps, 1),
        interpret=interpret,
    )(parts)
    return tuple(o[:n] for o in outs)


def _logits_kernel(h_ref, w_ref, temp_ref, out_ref, *, block_vocab, block_k, k_steps, vocab):
    """One vocab tile's fp32 logits / T: `_tile_logits` on the same blocks as `_split_kernel`, so
    each value has the bits the fused kernel reduces over (tested)."""
    _, temp = greedy_and_temperature(temp_ref[...])
    v0 = pl.multiple_of(pl.program_id(1) * block_vocab, block_vocab)
    logits = _tile_logits(h_ref, w_ref, v0, temp, block_vocab=block_vocab, block_k=block_k, k_steps=k_steps)
    if vocab is not None:
        cols = v0 + jnp.arange(block_vocab, dtype=jnp.int32)[None, :]
        logits = jnp.where(cols < vocab, logits, -jnp.inf)
    out_ref[...] = logits


def _logits(h, w, temperature, config: LogprobConfig, interpret: bool):
    """fp32 logits / T [N, V] (greedy rows: T = 1). Materialised: only for the rows that need them."""
    n, vocab = h.shape[0], w.shape[0]
    c = config
    h, w, temperature, masked_vocab = _pad(h, w, temperature, c)
    br, d = c.block_rows, h.shape[1]
    out = pl.pallas_call(
        functools.partial(
            _logits_kernel, block_vocab=c.block_vocab, block_k=c.block_k, k_steps=d // c.block_k, vocab=masked_vocab
        ),
        grid=(h.shape[0] // br, w.shape[0] // c.block_vocab),
        in_specs=[
            pl.BlockSpec((br, d), lambda i, j: (i, 0)),
            pl.BlockSpec(w.shape, lambda i, j: (0, 0)),
            pl.BlockSpec((br,), lambda i, j: (i,)),
        ],
        out_specs=pl.BlockSpec((br, c.block_vocab), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((h.shape[0], w.shape[0]), F32),
        compiler_params=compiler_params(c.num_warps, c.num_stages),
        interpret=interpret,
    )(h, w, temperature)
    return out[:n, :vocab]


def _minus_kernel(x_ref, lse_ref, o_ref):
    o_ref[...] = x_ref[...] - lse_ref[...][:, None]


def _minus_lse(x, lse, config: LogprobConfig, interpret: bool):
    """x [N, K] - lse [N, None]: logits to logprobs, the same one fp32 subtraction `_merge_kernel`
    does for the sampled token, so a token's value is the same bits in either list."""
    n, k = x.shape
    br, bk = config.block_rows, pl.next_power_of_2(k)
    xp, lp = pad_dim(pad_dim(x, 0, br), 1, bk), pad_dim(lse, 0, br)
    out = pl.pallas_call(
        _minus_kernel,
        grid=(xp.shape[0] // br,),
        in_specs=[pl.BlockSpec((br, bk), lambda i: (i, 0)), pl.BlockSpec((br,), lambda i: (i,))],
        out_specs=pl.BlockSpec((br, bk), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(xp.shape, F32),
        compiler_params=compiler_params(config.num_warps, 1),
        interpret=interpret,
    )(xp, lp)
    return out[:n, :k]


def _top_logprobs(h, w, temperature, lse, k: int, config: LogprobConfig, interpret: bool):
    """The k most likely ids per row (descending; equal logits: lowest id first) and their logprobs."""
    if not 1 <= k <= w.shape[0]:
        raise ValueError(f"k={k} top logprobs must be in [1, vocab={w.shape[0]}]")
    values, ids = jax.lax.top_k(_logits(h, w, temperature, config, interpret), k)  # selection: no rounding
    return ids.astype(jnp.int32), _minus_lse(values, lse, config, interpret)


class Logprobs(NamedTuple):
    """What the head returns per row (None where the option was not asked for)."""

    tokens: jax.Array | None  # [N] int32: the drawn tokens, or the targets scored (None: the caller has them)
    logprobs: jax.Array  # [N] fp32: their logprobs under softmax(logits / T)
    renormalised: jax.Array | None = None  # [N] fp32: under the truncated, renormalised distribution
    top_ids: jax.Array | None = None  # [N, k] int32: the k most likely ids, descending
    top_logprobs: jax.Array | None = None  # [N, k] fp32: their logprobs


def head(
    h, w, temperature, config, interpret: bool, *, targets=None, seeds=None, steps=None, top_logprobs=0, truncation=None
) -> Logprobs:
    """The lm_head and log-softmax over h [N, D] @ w [V, D].T / temperature [N], for the learner or the
    sampler: scores `targets` [N], or draws one token per row keyed by (seeds, steps) [N].

    top_logprobs = k > 0: also each row's k most likely ids and their logprobs (the full
    distribution's; materialises [N, V] fp32 logits). truncation = (top_k [N] int32 in [1, V], top_p
    [N] fp32 in (0, 1], min_p [N] fp32 in [0, 1]) (pallas_kernels.truncation): draw from (or score
    under) the truncated, renormalised distribution, and give that logprob as `renormalised`; the
    full distribution's logprob comes from the same fused kernel either way (the learner's bits by
    construction). Scoring targets without options is differentiable (a streamed backward that
    never holds [N, V]); the rest is not. A drawn token and a scored target have the same logprob
    bits, with or without top logprobs."""
    sampling = targets is None
    if sampling == (seeds is None or steps is None):
        raise ValueError("head takes targets (to score) or seeds and steps (to sample), not both")
    if not sampling and not top_logprobs and truncation is None:
        return Logprobs(targets, _token_logprobs(h, w, targets, temperature, config, interpret))
    _check(h, w, temperature, *((seeds, steps) if sampling else (targets,)), *(truncation or ()))
    if sampling:
        targets = jnp.zeros(seeds.shape, jnp.int32)
        keys = _math.row_key(seeds, steps)
    else:
        keys = jnp.zeros(targets.shape, jnp.uint32)
    if truncation is not None:
        z = _logits(h, w, temperature, config, interpret)
        tok, renorm, tgt_renorm, values, ids = truncate(z, targets, keys, temperature, truncation, config, interpret)
        scored = tok if sampling else targets
        lp, _, _, lse = _fused(h, w, scored, temperature, keys, config, interpret)  # the learner's kernel
        out = Logprobs(scored, lp, renorm if sampling else tgt_renorm)
        if top_logprobs:  # the k largest of the logits the kept set was chosen from
            top_ids = ids[:, :top_logprobs].astype(jnp.int32)
            out = out._replace(
                top_ids=top_ids, top_logprobs=_minus_lse(values[:, :top_logprobs], lse, config, interpret)
            )
        return out
    target_lp, tokens, sampled_lp, lse = _fused(h, w, targets, temperature, keys, config, interpret)
    out = Logprobs(tokens, sampled_lp) if sampling else Logprobs(targets, target_lp)
    if top_logprobs:
        top_ids, top_lp = _top_logprobs(h, w, temperature, lse, top_logprobs, config, interpret)
        out = out._replace(top_ids=top_ids, top_logprobs=top_lp)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _token_logprobs(h, w, targets, temperature, config: LogprobConfig, interpret: bool):
    """log softmax(h @ w.T / temperature)[targets] -> [N] fp32, differentiable (logprob_bwd.backward)."""
    return _fwd(h, w, targets, temperature, config, interpret)[0]


def _fwd(h, w, targets, temperature, config, interpret):
    _check(h, w, targets, temperature)
    keys = jnp.zeros(targets.shape, jnp.uint32)
    lp, _, _, lse = _fused(h, w, targets, temperature, keys, config, interpret)
    return lp, (h, w, targets, temperature, lse)


_token_logprobs.defvjp(_fwd, logprob_bwd.backward)


def logits_reference(h, w, temperature):
    """fp32 logits / T [N, V] in plain XLA (greedy rows: T = 1)."""
    acc = acc_dtype(h.dtype)
    temperature = temperature.astype(acc)
    temperature = jnp.where(temperature == 0, jnp.ones_like(temperature), temperature)  # greedy: T = 1
    return jnp.dot(h, w.T, preferred_element_type=acc) / temperature[:, None]


def _gumbel_argmax(scores, temperature, seeds, steps):
    """The sampler's draw in plain XLA: the kernel's Gumbel noise (greedy rows: none), argmax with
    ties to the lowest id (jnp.argmax), so fast and strict draw the same tokens up to rounding."""
    cols = jnp.arange(scores.shape[1], dtype=jnp.int32)[None, :]
    noise = _math.gumbel_noise(_math.row_key(seeds, steps)[:, None], cols)
    return jnp.argmax(jnp.where((temperature == 0)[:, None], scores, scores + noise), axis=1).astype(jnp.int32)


def head_reference(
    h,
    w,
    temperature,
    config=None,
    interpret=None,
    *,
    targets=None,
    seeds=None,
    steps=None,
    top_logprobs=0,
    truncation=None,
) -> Logprobs:
    """`head` in plain XLA (materialised fp32 logits, jax.nn.log_softmax): what `numerics="fast"` runs."""
    if truncation is not None:
        z, lse, lse_kept, zk, values, ids = truncate_reference(logits_reference(h, w, temperature), *truncation)
        if targets is None:
            tok = _gumbel_argmax(zk, temperature, seeds, steps)
            logit = jnp.take_along_axis(z, tok[:, None], axis=1)[:, 0]
            out = Logprobs(tok, logit - lse, logit - lse_kept)
        else:
            at = targets[:, None].astype(jnp.int32)
            lp = jnp.take_along_axis(z, at, axis=1)[:, 0] - lse
            out = Logprobs(targets, lp, jnp.take_along_axis(zk, at, axis=1)[:, 0] - lse_kept)
        if top_logprobs:
            k = top_logprobs
            out = out._replace(top_ids=ids[:, :k].astype(jnp.int32), top_logprobs=values[:, :k] - lse[:, None])
        return out
    logits = logits_reference(h, w, temperature)
    if targets is None:
        targets = _gumbel_argmax(logits, temperature, seeds, steps)
    logp = jax.nn.log_softmax(logits, axis=-1)
    out = Logprobs(targets, jnp.take_along_axis(logp, targets[:, None].astype(jnp.int32), axis=1)[:, 0])
    if top_logprobs:
        values, ids = jax.lax.top_k(jax.nn.log_softmax(logits_reference(h, w, temperature), axis=-1), top_logprobs)
        out = out._replace(top_ids=ids.astype(jnp.int32), top_logprobs=values)
    return out
