"""The learner's attention backward as Pallas kernels (flash-attention style): dq, dk, dv of causal
GQA attention over whole sequences, without the [B, H, T, T] probabilities that XLA's dense
backward materialises in fp32 (at 4 x 4096 tokens and 32 heads: 8 GiB per layer).

Shapes as `attention.paged_attention`'s learner pass: q [B, T, Hq, Dh], k, v [B, T, Hkv, Dh], out
and its cotangent do [B, T, Hq, Dh], positions [B, T] (-1 = padding). A key is visible to a query
when 0 <= pos_k <= pos_q (the forward's mask: every key a query sees was written by this call).

Two kernels, each program with a fixed loop order and no atomics, so the gradient is the same
bits on every run (not bitwise-promised against anything else, like every gradient here). Each
query row's log-sum-exp of its scaled scores comes from the forward (its merge kernel writes it),
so no kernel recomputes the scores only to normalise them:
  dkdv:  one program per (batch row, KV head, key block): loops over the group's query heads, then
         the query blocks in ascending order, adding p^T do and ds^T q;
  dq:    one program per (batch row, query head, query block): loops over the key blocks in order.
A (query block, key block) pair is skipped when no query of the one can see any key of the other
(the block's highest query position is below its lowest valid key position, from the positions
themselves, not assumed from indices): such a pair would add exact zeros, so skipping it changes no
bit (tested), and causal sequences skip about half the pairs.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import F32, check_block, compiler_params, dot_nn, dot_nt, pad_dim


@dataclasses.dataclass(frozen=True)
class AttentionBwdConfig:
    block_q: int = 64  # the dkdv kernel's query and key blocks
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    skip_blocks: bool = True  # skip pairs that see nothing (False: to measure it, and test that no bit changes)
    # The dq kernel's blocks (0: block_q, block_k). The two kernels walk opposite loops (dkdv holds a key
    # block and walks the queries, dq the reverse), so each may want its held block the taller.
    dq_block_q: int = 0
    dq_block_k: int = 0

    def __post_init__(self):
        check_block("block_q", self.block_q)
        check_block("block_k", self.block_k)
        for name in ("dq_block_q", "dq_block_k"):
            if getattr(self, name):
                check_block(name, getattr(self, name))

    @property
    def dq_blocks(self) -> tuple[int, int]:
        return self.dq_block_q or self.block_q, self.dq_block_k or self.block_k


def _visible(pos_q, pos_k):
    """[bq, bk]: the forward's mask (a key at a valid position up to the query's)."""
    return (pos_k[None, :] <= pos_q[:, None]) & (pos_k[None, :] >= 0)


def _probs(q, k, pos_q, pos_k, lse, scale):
    """p [bq, bk] = exp(q k^T * scale - lse) where visible, else exact 0."""
    return jnp.where(_visible(pos_q, pos_k), jnp.exp(dot_nt(q, k) * scale - lse[:, None]), 0.0)


def _sees(q_hi, k_lo, compute, carry):
    """compute(carry) if a query at position <= q_hi can see a key at position >= k_lo, else carry."""
    return jax.lax.cond(k_lo <= q_hi, compute, lambda c: c, carry)


def _dkdv_kernel(position_refs, q_ref, k_ref, v_ref, do_ref, row_refs, dk_ref, dv_ref, *, block_q, scale):
    """dk, dv of one key block over every query block that sees it. position_refs: (per query block its
    highest position, per key block its lowest, query positions, key positions); row_refs: (lse,
    delta) per query row."""
    q_hi_ref, k_lo_ref, pos_q_ref, pos_k_ref = position_refs
    lse_ref, delta_ref = row_refs
    k, v, pos_k, k_lo = k_ref[...], v_ref[...], pos_k_ref[...], k_lo_ref[0]
    groups, blocks = q_ref.shape[0], q_ref.shape[1] // block_q

    def block(g, i, carry):
        dk, dv = carry
        blk = pl.ds(i * block_q, block_q)
        q, do = q_ref[g, blk, :], do_ref[g, blk, :]
        p = _probs(q, k, pos_q_ref[blk], pos_k, lse_ref[g, blk], scale)
        dv = dv + dot_nn(p.astype(do.dtype).T, do)
        ds = p * (dot_nt(do, v) - delta_ref[g, blk][:, None]) * scale
        return dk + dot_nn(ds.astype(q.dtype).T, q), dv

    def head(g, carry):  # the group's heads one by one, each over the query blocks in order
        # (two nested loops, not one over g * blocks: Triton's lowering of the // and % that would
        # split the counter fails on the H200: "_mod: i32 vs i1")
        return jax.lax.fori_loop(
            0, blocks, lambda i, c: _sees(q_hi_ref[i], k_lo, functools.partial(block, g, i), c), carry
        )

    zeros = jnp.zeros(k.shape, F32)
    dk, dv = jax.lax.fori_loop(0, groups, head, (zeros, zeros))
    dk_ref[...], dv_ref[...] = dk, dv


def _dq_kernel(position_refs, q_ref, k_ref, v_ref, do_ref, row_refs, dq_ref, *, block_k, scale):
    """dq of one query block over every key block it sees (refs as `_dkdv_kernel`'s)."""
    q_hi_ref, k_lo_ref, pos_q_ref, pos_k_ref = position_refs
    lse_ref, delta_ref = row_refs
    q, do, pos_q, lse, delta = q_ref[...], do_ref[...], pos_q_ref[...], lse_ref[...], delta_ref[...]
    q_hi = q_hi_ref[0]

    def block(j, dq):
        blk = pl.ds(j * block_k, block_k)
        k, v = k_ref[blk, :], v_ref[blk, :]
        p = _probs(q, k, pos_q, pos_k_ref[blk], lse, scale)
        ds = p * (dot_nt(do, v) - delta[:, None]) * scale
        return dq + dot_nn(ds.astype(k.dtype), k)

    def body(j, dq):
        return _sees(q_hi, k_lo_ref[j], functools.partial(block, j), dq)

    dq_ref[...] = jax.lax.fori_loop(0, k_ref.shape[0] // block_k, body, jnp.zeros(q.shape, F32))


def attention_bwd(q, k, v, forward, do, positions, config: AttentionBwdConfig, interpret: bool):
    """(dq, dk, dv) of causal GQA attention (see the module docstring), in q's dtype. forward: the
    forward's (out, lse), out [B, T, Hq, Dh] and lse [B, T, Hq] each row's log-sum-exp of its scaled
    scores (+inf for a row that sees no key, so its probabilities are exact zeros)."""
    out, lse = forward
    b, t, hq, dh = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = 1.0 / math.sqrt(dh)
    dh_p = max(16, pl.next_power_of_2(dh))  # zero features: exact zero products, sliced off after
    block = max(config.block_q, config.block_k, *config.dq_blocks)
    tp = -(-t // block) * block  # padding positions are -1: seen by no query, see no key

    def heads_major(x):  # [B, T, H, Dh] -> [B, H, Tp, Dh_p]
        return pad_dim(pad_dim(x, 1, block), 3, dh_p).transpose(0, 2, 1, 3)

    qh, kh, vh, doh = heads_major(q), heads_major(k), heads_major(v), heads_major(do)
    # delta = rowsum(do * out): the softmax backward's per-row term, in fp32 (elementwise XLA).
    delta = jnp.sum(do.astype(F32) * out.astype(F32), axis=3).transpose(0, 2, 1)
    delta = pad_dim(delta, 2, block)  # [B, Hq, Tp]
    pos = pad_dim(positions, 1, block, value=-1)

    def bounds(bq, bk):
        """Per block: the highest query position (-1: all padding) and the lowest valid key position
        (int32 max: none), for skipping the pairs that see nothing."""
        q_hi = pos.reshape(b, tp // bq, bq).max(axis=2)
        k_lo = jnp.where(pos >= 0, pos, jnp.iinfo(jnp.int32).max).reshape(b, tp // bk, bk).min(axis=2)
        if not config.skip_blocks:
            return jnp.full_like(q_hi, jnp.iinfo(jnp.int32).max), jnp.full_like(k_lo, -1)
        return q_hi, k_lo

    bq, bk = config.block_q, config.block_k
    q_hi, k_lo = bounds(bq, bk)
    one = lambda: pl.BlockSpec((None, 1), lambda i, h, j: (i, j))  # noqa: E731  (this program's block)
    every = lambda n: pl.BlockSpec((None, n), lambda i, h, j: (i, 0))  # noqa: E731  (all blocks of the row)
    params = compiler_params(config.num_warps, config.num_stages)
    seq = lambda n: pl.BlockSpec((None, n), lambda i, h, j: (i, 0))  # noqa: E731  (positions, whole row)
    pos_blk = lambda n: pl.BlockSpec((None, n), lambda i, h, j: (i, j))  # noqa: E731

    lse = pad_dim(lse.transpose(0, 2, 1), 2, block, value=jnp.inf)  # [B, Hq, Tp]; padding sees no key

    group = lambda *blk: pl.BlockSpec((None, g, *blk), lambda i, h, j: (i, h, *[0] * len(blk)))  # noqa: E731
    kv_blk = pl.BlockSpec((None, None, bk, dh_p), lambda i, h, j: (i, h, j, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, block_q=bq, scale=scale),
        name="attention_bwd_dkdv",
        grid=(b, hkv, tp // bk),
        in_specs=[(every(tp // bq), one(), seq(tp), pos_blk(bk)), group(tp, dh_p), kv_blk, kv_blk, group(tp, dh_p)]
        + [(group(tp), group(tp))],
        out_specs=[kv_blk, kv_blk],
        out_shape=[jax.ShapeDtypeStruct(kh.shape, F32)] * 2,
        compiler_params=params,
        interpret=interpret,
    )((q_hi, k_lo, pos, pos), qh, kh, vh, doh, (lse, delta))

    if config.dq_blocks != (bq, bk):
        bq, bk = config.dq_blocks
        q_hi, k_lo = bounds(bq, bk)
    q_blk = pl.BlockSpec((None, None, bq, dh_p), lambda i, h, j: (i, h, j, 0))
    kv_seq = pl.BlockSpec((None, None, tp, dh_p), lambda i, h, j: (i, h // g, 0, 0))
    row_blk = pl.BlockSpec((None, None, bq), lambda i, h, j: (i, h, j))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, block_k=bk, scale=scale),
        name="attention_bwd_dq",
        grid=(b, hq, tp // bq),
        in_specs=[(one(), every(tp // bk), pos_blk(bq), seq(tp)), q_blk, kv_seq, kv_seq, q_blk, (row_blk, row_blk)],
        out_specs=q_blk,
        out_shape=jax.ShapeDtypeStruct(qh.shape, F32),
        compiler_params=params,
        interpret=interpret,
    )((q_hi, k_lo, pos, pos), qh, kh, vh, doh, (lse, delta))

    def back(x, like):  # [B, H, Tp, Dh_p] fp32 -> [B, T, H, Dh] in like's dtype
        return x.transpose(0, 2, 1, 3)[:, :t, :, :dh].astype(like.dtype)

    return back(dq, q), back(dk, k), back(dv, v)
