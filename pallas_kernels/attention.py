"""Causal GQA attention over a paged KV cache: the one kernel for the learner's full-sequence
pass, prefill, chunked prefill and single-token decode.

Shapes (B batch, T tokens this call, Hq/Hkv heads, G = Hq/Hkv, Dh head dim, P pages per row):
  q        [B, T, Hq, Dh]   already normed and RoPE'd (pallas_kernels.rmsnorm)
  k, v     [B, T, Hkv, Dh]  this call's keys/values, written into the cache *before* attending
  k_pages  [L, Hkv, num_pages, page_size, Dh] every layer's cache (v_pages the same), `layer` an
           int32 scalar: the kernel reads its layer in place, so a scan over layers copies nothing.
           Page 0 is the trash page that padding tokens write to, never read by a real query
  plan     `plan(page_table, positions, G, config)`: page_table [B, P] int32 physical page of each
           logical page and positions [B, T] int32 (-1 = padding), in the layouts the kernels read.
           Computed once per forward, outside the layer scan: every layer reads the same plan
           (index arithmetic per layer was ~5 small XLA launches each, 5-10% of a decode step)
Returns out [B, T, Hq, Dh] and the updated caches.

Numerics: keys are visited in blocks of `block_pages` pages aligned to absolute positions (block j
holds positions [j*B, (j+1)*B), B = block_pages * page_size), in ascending order, with an fp32
online softmax: per block, the row max of the pages' scores (exact in any order), p = exp(s - max),
and, page by page in order, p (rounded to v's dtype) @ v into the output. The row sum of p is
`row_sums`, part of the contract:
- "reduce": the pages' p added elementwise in page order, then one `jnp.sum` over the columns. On
  the GPU that reduction's order follows the tile's register layout (16- and 64-row tiles differed
  in the last bit), so every pass runs the same `block_rows`-row tiles.
- "product": p rounded to v's dtype @ ones, page by page in order. Every reduction over a row's
  keys is then a product, whose K chain is the same whatever the tile's row count (measured: the
  matmul's rows across 16- to 256-row tiles), so the rows per program become a launch choice:
  decode steps run `block_rows` rows, calls with many query tiles `long_rows`.
Either way a token's bits depend on its own keys only: not on the chunking, the batch, or the other
queries in its tile. A query row's state is only updated by blocks in which it sees at least one
key (a select, so later blocks are exact no-ops). A program runs `tiles` tiles side by side (each
its own arithmetic, sharing the KV block loads), which changes no bit either.

KV splits (flash-decoding): the positions are cut into fixed absolute ranges of `kv_split` keys
(split s holds [s*kv_split, (s+1)*kv_split)); the online softmax above runs over each split's range
from a fresh state, and the splits' (acc, max, sum) are merged in ascending order. Every pass
(decode, prefill, the learner's) splits and merges the same way. Where it happens depends only on
the call's shape, never on the bits: with few query tiles (a decode step) one program per (query
tile, split), so one token gets batch x KV heads x splits programs, and a second kernel merges
(one program per tile and block of head-dim columns, with the next splits' states loading while
it merges: `_merge_kernel`); with many (`merge_in_kernel_from`: the learner's rows, long prefill
chunks) one program per tile group walks its splits in turn and merges each as it finishes, with
the merge kernel's arithmetic (`_merge_step`). A split a row does not reach is an exact no-op in
the merge (a select); a split past a tile's last position is skipped.
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _math
from pallas_kernels.attention_bwd import AttentionBwdConfig, attention_bwd
from pallas_kernels.common import F32, acc_dtype, check_block, compiler_params, dot_nn, dot_nt, pad_dim, round_up

ROW_SUM_COLUMNS = 16  # the ones matrix of the row sums: Triton's smallest dot width


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    page_size: int = 16  # tokens per KV cache page
    block_rows: int = 16  # query rows (tokens x group heads) per tile of a decode step or a short chunk
    kv_split: int = 256  # keys per split, merged in order afterwards; changing it changes the bits
    num_warps: int = 4
    num_stages: int = 2
    block_pages: int = 1  # pages per online-softmax step (the KV block); changing it changes the bits
    # Query tiles per program (at most; fewer where a call has fewer): they share each KV block
    # load, and each runs the one-tile arithmetic on its own block_rows rows, so no bit changes
    # (tested compiled: tests/test_kernels.py test_attention_tiles_per_program_agree).
    tiles: int = 1
    # A call with at least this many query tiles per row runs one program per tile group that merges
    # its KV splits itself (no split states written and read back, no merge launch); fewer (decode,
    # short prefill chunks) a program per split and a merge kernel for parallelism. The same bits
    # (tested: tests/test_kernels.py test_attention_chunked_equals_whole_and_decode). Why 8:
    # bench/results/2026-12-03_h200_cpu_measurements_behind_defaults.md.
    merge_in_kernel_from: int = 8
    # How a block's probabilities are summed per row: "reduce" or "product" (module docstring).
    row_sums: str = "reduce"
    # Calls merging in the kernel: query rows and warps per program (0: block_rows, num_warps). With
    # row_sums "product" a launch choice (tested compiled: tests/test_kernels.py
    # test_attention_long_rows_agree); with "reduce" it would change a row's bits, so it must be 0.
    long_rows: int = 0
    long_warps: int = 0
    # The merge kernel (decode, short prefill chunks): split states loaded ahead of the one being
    # merged, head-dim columns per program, warps. Launch choices only: the same steps in the same
    # order on every element (tested: tests/test_kernels.py test_attention_merge_launch_keeps_bits).
    merge_prefetch: int = 8
    merge_block_d: int = 32
    merge_warps: int = 4
    # The learner's gradient: None = XLA's dense backward (dense_attention's vjp); a config = the
    # Pallas flash backward (attention_bwd.py: no [B, H, T, T] arrays). Neither changes a logprob.
    backward: AttentionBwdConfig | None = None

    def __post_init__(self):
        check_block("page_size", self.page_size)
        check_block("block_rows", self.block_rows)
        check_block("kv_split", self.kv_split)
        check_block("block_pages", self.block_pages, minimum=1)
        check_block("tiles", self.tiles, minimum=1)
        check_block("merge_prefetch", self.merge_prefetch, minimum=1)
        check_block("merge_block_d", self.merge_block_d)
        check_block("merge_warps", self.merge_warps, minimum=1)
        if self.row_sums not in ("reduce", "product"):
            raise ValueError(f"row_sums={self.row_sums!r} must be 'reduce' or 'product'")
        if self.long_rows not in (0, self.block_rows) and self.row_sums != "product":
            raise ValueError(
                f"long_rows={self.long_rows} with row_sums='reduce' would give the learner's rows other bits than "
                f"a decode step's {self.block_rows}-row tiles: use row_sums='product' or long_rows=0"
            )
        if self.long_rows:
            check_block("long_rows", self.long_rows)
        if self.long_warps:
            check_block("long_warps", self.long_warps, minimum=1)
        if self.kv_split % (self.page_size * self.block_pages):
            raise ValueError(
                f"kv_split={self.kv_split} must be a multiple of page_size x block_pages = "
                f"{self.page_size * self.block_pages}"
            )

    def rows(self, tokens: int, group: int) -> tuple[int, bool]:
        """(query rows per tile, whether its KV splits merge in the attention kernel) for a call of
        `tokens` query tokens per batch row and `group` (a power of two) query heads per KV head."""
        bq = max(1, self.block_rows // group)
        if round_up(tokens, bq) // bq < self.merge_in_kernel_from:
            return self.block_rows, False
        return self.long_rows or self.block_rows, True


class Plan(NamedTuple):
    """The index arrays every layer's attention call of one forward shares (pure data movement)."""

    page_table: jax.Array  # [B, P'] padded to whole KV blocks (strict) or as given (reference)
    positions: jax.Array  # [B, T]
    write_page: jax.Array  # [B*T] the physical page each new key/value goes to (padding: trash page 0)
    write_slot: jax.Array  # [B*T] its slot in that page
    row_pos: jax.Array | None  # [B, Tp*G'] each query row's position in the kernel's layout (strict only)


def plan(page_table, positions, group: int, page_size: int, config: "AttentionConfig | None" = None) -> Plan:
    """The plan of one forward for `group` query heads per KV head: for the kernel with `config`, or
    (None) for the reference."""
    valid = positions >= 0
    pos = jnp.where(valid, positions, 0)
    page = jnp.where(valid, jnp.take_along_axis(page_table, pos // page_size, axis=1), 0).reshape(-1)
    slot = jnp.where(valid, pos % page_size, 0).reshape(-1)
    if config is None:
        return Plan(page_table, positions, page, slot, None)
    g_p = pl.next_power_of_2(group)  # query heads per KV head in the kernel (see padded_attention)
    bq = max(1, config.rows(positions.shape[1], g_p)[0] // g_p)
    row_pos = jnp.repeat(pad_dim(positions, 1, bq, value=-1), g_p, axis=1)
    # whole blocks: extra entries read the trash page
    return Plan(pad_dim(page_table, 1, max(16, config.block_pages)), positions, page, slot, row_pos)


def write_kv(pages, new, layer, plan: Plan):
    """Scatter new [B, T, Hkv, Dh] into pages[layer] at the plan's (page, slot). Pure data movement."""
    b, t, hkv, dh = new.shape
    # layer, page and slot are the advanced indices, so the update is laid out [B*T, Hkv, Dh].
    return pages.at[layer, :, plan.write_page, plan.write_slot].set(new.reshape(b * t, hkv, dh).astype(pages.dtype))


def _split_states(layer, pt_ref, k_ref, v_ref, qs, poss, first, last, *, page_size, block_pages, scale, row_sums):
    """The online softmax of each query tile (qs, poss: [rows, Dh] and [rows] per tile) over KV
    blocks [first, last) from a fresh state: ((acc, m, l) per tile). Each KV block is loaded once
    and used by every tile, and each tile runs exactly the single-tile arithmetic on its own rows (a
    block a tile does not see is an exact no-op for it), so the number of tiles changes no bit."""

    def update(q, pos, keys, values, j, carry):
        acc, m, l = carry
        # The block's pages one by one (they are not contiguous): scores, then one row max over
        # their elementwise max, then the row sums as `row_sums` says (module docstring).
        scores = []
        for i, k in enumerate(keys):
            s = dot_nt(q, k) * scale  # [rows, ps]
            key_pos = (j * block_pages + i) * page_size + jnp.arange(page_size, dtype=jnp.int32)
            scores.append(jnp.where(key_pos[None, :] <= pos[:, None], s, -jnp.inf))
        s_max = scores[0]
        for s in scores[1:]:
            s_max = jnp.maximum(s_max, s)
        m_blk = jnp.max(s_max, axis=1)
        sees = m_blk > -jnp.inf
        m_new = jnp.where(sees, jnp.maximum(m, m_blk), 0.0)
        alpha = _math.exp(m - m_new)
        probs = [_math.exp(s - m_new[:, None]) for s in scores]  # masked keys: exp(-inf) = exact 0
        if row_sums == "product":
            # rounded once, for p @ v and p @ ones alike; every column of p @ ones holds the same
            # sum, which the max takes exactly
            probs = [p.astype(v.dtype) for p, v in zip(probs, values)]
            ones = jnp.ones((page_size, ROW_SUM_COLUMNS), probs[0].dtype)
            sums = dot_nn(probs[0], ones)
            for p in probs[1:]:
                sums = sums + dot_nn(p, ones)
            l_new = alpha * l + jnp.max(sums, axis=1)
        else:
            p_sum = probs[0]
            for p in probs[1:]:
                p_sum = p_sum + p
            l_new = alpha * l + jnp.sum(p_sum, axis=1)
        acc_new = alpha[:, None] * acc
        for p, v in zip(probs, values):
            acc_new = acc_new + dot_nn(p.astype(v.dtype), v)
        return jnp.where(sees[:, None], acc_new, acc), jnp.where(sees, m_new, m), jnp.where(sees, l_new, l)

    def body(j, carry):
        pages = [pt_ref[j * block_pages + i] for i in range(block_pages)]
        keys = [k_ref[layer, page] for page in pages]  # [ps, Dh] each
        values = [v_ref[layer, page] for page in pages]
        return tuple(update(q, pos, keys, values, j, c) for q, pos, c in zip(qs, poss, carry))

    return jax.lax.fori_loop(first, last, body, (_fresh_state(*qs[0].shape),) * len(qs))


def _tiles(q_ref, pos_ref, rows):
    tiles = q_ref.shape[0] // rows
    qs = [q_ref[pl.ds(t * rows, rows), :] for t in range(tiles)]  # [rows, Dh] each, rows token-major
    return qs, [pos_ref[pl.ds(t * rows, rows)] for t in range(tiles)]


def _kernel(layer_ref, pt_ref, pos_ref, q_ref, kv_refs, acc_ref, m_ref, l_ref, *, rows, kv_split, **kw):
    """One (group of query tiles, KV split): the split's (acc, max, sum) per row, for the merge."""
    k_ref, v_ref = kv_refs
    block = kw["page_size"] * kw["block_pages"]
    first = pl.program_id(3) * (kv_split // block)
    last = jnp.minimum(first + kv_split // block, jnp.max(pos_ref[...]) // block + 1)  # -1: padding

    @pl.when(first < last)  # splits past the tiles' last position are never read by the merge
    def _():
        qs, poss = _tiles(q_ref, pos_ref, rows)
        out = _split_states(layer_ref[0], pt_ref, k_ref, v_ref, qs, poss, first, last, **kw)
        for t, (acc, m, l) in enumerate(out):
            acc_ref[pl.ds(t * rows, rows), :] = acc
            m_ref[pl.ds(t * rows, rows)] = m
            l_ref[pl.ds(t * rows, rows)] = l


def _merge_step(merged, split):
    """Add one split's (acc, max, sum) to the running merge; a split a row does not see (l = 0) is
    skipped by a select, so it changes nothing."""
    (acc, m, l), (acc_s, m_s, l_s) = merged, split
    sees = l_s > 0
    m_new = jnp.maximum(m, m_s)
    alpha, beta = _math.exp(m - m_new), _math.exp(m_s - m_new)
    l_new = alpha * l + beta * l_s
    acc_new = alpha[:, None] * acc + beta[:, None] * acc_s
    return jnp.where(sees[:, None], acc_new, acc), jnp.where(sees, m_new, m), jnp.where(sees, l_new, l)


def _fresh_state(rows, dh):
    """(acc, max, sum) of rows that have seen no key: a split's start and the merge's."""
    return jnp.zeros((rows, dh), F32), jnp.full((rows,), -jnp.inf, F32), jnp.zeros((rows,), F32)


def _finish(merged, dtype):
    """(out, log-sum-exp of the scaled scores) per row: 0 and +inf for a row that sees no key."""
    acc, m, l = merged
    seen = l > 0
    safe = jnp.where(seen, l, 1.0)
    return jnp.where(seen[:, None], acc / safe[:, None], 0.0).astype(dtype), jnp.where(seen, m + jnp.log(safe), jnp.inf)


def _merge_kernel(pos_ref, acc_ref, m_ref, l_ref, o_ref, lse_ref, *, kv_split, prefetch):
    """Merge the splits a tile reaches, in ascending order, for a block of its head-dim columns.
    Also writes each row's log-sum-exp of its scaled scores (the first column block), which the
    learner's backward reads. Every column block computes its rows' (max, sum) chain itself: the
    same operations on the same values, so the blocks change no bit.

    The states of the next `prefetch` splits travel in the loop's carry: each step merges the
    oldest and loads the one `prefetch` splits ahead, so that load is in flight while the steps
    between run. Loaded and used in one step, the compiler issues a state's loads next to their
    use (ptxas did, for any unrolling), and every split then costs two or more round trips to
    memory, one after another: the merge's whole cost when a decode step at long context merges
    64 splits or more per tile. Loads past the last split read a clamped index and go unused."""
    num_splits = jnp.maximum(jnp.max(pos_ref[...]), -1) // kv_split + 1
    last = acc_ref.shape[0] - 1

    def load(s):
        s = jnp.minimum(s, last)
        return acc_ref[s], m_ref[s], l_ref[s]

    def body(s, carry):
        merged, ahead = carry[0], carry[1:]
        return _merge_step(merged, ahead[0]), *ahead[1:], load(s + prefetch)

    ahead = tuple(load(s) for s in range(prefetch))
    merged = jax.lax.fori_loop(0, num_splits, body, (_fresh_state(*o_ref.shape), *ahead))[0]
    o_ref[...], lse = _finish(merged, o_ref.dtype)

    @pl.when(pl.program_id(3) == 0)
    def _():
        lse_ref[...] = lse


def _fused_kernel(layer_ref, pt_ref, pos_ref, q_ref, kv_refs, o_ref, lse_ref, *, rows, kv_split, **kw):
    """`_kernel` for every split of a group of query tiles in turn, each merged as it is done
    (`_merge_step`, the merge kernel's arithmetic, the same order): the same bits, without writing
    the splits' states to memory and reading them back, in one launch. Splits a tile does not reach
    (the group reaches further) leave its rows' l = 0: skipped by the merge's select, as the merge
    kernel's shorter loop skips them."""
    k_ref, v_ref = kv_refs
    block = kw["page_size"] * kw["block_pages"]
    per_split, max_pos = kv_split // block, jnp.max(pos_ref[...])
    qs, poss = _tiles(q_ref, pos_ref, rows)

    def body(s, merged):
        first = s * per_split
        last = jnp.minimum(first + per_split, max_pos // block + 1)
        states = _split_states(layer_ref[0], pt_ref, k_ref, v_ref, qs, poss, first, last, **kw)
        return tuple(_merge_step(mg, st) for mg, st in zip(merged, states))

    num_splits = jnp.maximum(max_pos, -1) // kv_split + 1
    merged = jax.lax.fori_loop(0, num_splits, body, (_fresh_state(rows, q_ref.shape[1]),) * len(qs))
    for t, state in enumerate(merged):
        o_ref[pl.ds(t * rows, rows), :], lse_ref[pl.ds(t * rows, rows)] = _finish(state, o_ref.dtype)


def padded_attention(q, k_pages, v_pages, layer, plan: Plan, config, interpret):
    """Triton tiles are powers of two: a head dim that is not one (or is < 16, the smallest dot)
    gets zero features on q, k and v (exact zero products; the zero output columns are sliced
    away), with the scale from the true head dim; a group size that is not one gets zero query
    heads, computed and dropped (each query row's softmax is its own). Only the layer being read
    is copied and padded. Power-of-two shapes go straight through."""
    b, t, hq, dh = q.shape
    hkv = k_pages.shape[1]
    g = hq // hkv
    dh_p, g_p = max(16, pl.next_power_of_2(dh)), pl.next_power_of_2(g)
    if (dh_p, g_p) == (dh, g):
        return _pallas_attention(q, k_pages, v_pages, layer, plan, config, interpret)
    if dh_p != dh:
        k_pages, v_pages = (pad_dim(jax.lax.dynamic_index_in_dim(p, layer, 0), 4, dh_p) for p in (k_pages, v_pages))
        layer = jnp.int32(0)
    q = pad_dim(pad_dim(q.reshape(b, t, hkv, g, dh), 3, g_p), 4, dh_p).reshape(b, t, hkv * g_p, dh_p)
    scale = 1.0 / math.sqrt(dh)
    out, lse = _pallas_attention(q, k_pages, v_pages, layer, plan, config, interpret, scale=scale)
    lse = lse.reshape(b, t, hkv, g_p)[:, :, :, :g].reshape(b, t, hq)
    return out.reshape(b, t, hkv, g_p, dh_p)[:, :, :, :g, :dh].reshape(b, t, hq, dh), lse


def _pallas_attention(q, k_pages, v_pages, layer, plan: Plan, config, interpret, scale=None):
    b, t, hq, dh = q.shape
    num_layers, hkv, num_pages, ps, _ = k_pages.shape
    g = hq // hkv
    # A tile is `rows` query rows (bq tokens x G heads): 16 for a decode step (its one token fills
    # a quarter of it at G = 4); with row_sums "product" more for the learner's rows and long
    # prefill chunks, whose tiles then fill the tensor cores' 64-row instructions (module docstring).
    rows, in_kernel = config.rows(t, g)
    bq = max(1, rows // g)
    tp = round_up(t, bq)
    check_block("query rows per program", bq * g)
    check_block("head_dim", dh)
    # [B, T, Hkv*G, Dh] -> [B, Hkv, T*G, Dh]: the G query heads of a KV head share its key loads.
    qh = pad_dim(q, 1, bq).reshape(b, tp, hkv, g, dh).transpose(0, 2, 1, 3, 4).reshape(b, hkv, tp * g, dh)
    pt, row_pos = plan.page_table, plan.row_pos
    if row_pos is None or row_pos.shape != (b, tp * g):
        raise ValueError(f"attention plan not made for this kernel's {tp * g} query rows: plan(..., config=) it")
    splits = -(-pt.shape[1] * ps // config.kv_split)
    rows = bq * g
    warps = (config.long_warps or config.num_warps) if in_kernel else config.num_warps
    # Tiles per program: the largest power of two up to config.tiles that divides the call's tiles
    # (a decode step's one tile runs alone; the learner's 4096-token rows group them).
    tiles = math.gcd(tp // bq, config.tiles)
    grouped = rows * tiles

    kernel_args = dict(
        rows=rows,
        page_size=ps,
        block_pages=config.block_pages,
        kv_split=config.kv_split,
        scale=scale or 1.0 / math.sqrt(dh),
        row_sums=config.row_sums,
    )
    in_specs = [  # index maps for either grid: (batch, KV head, tile group[, split])
        pl.BlockSpec((1,), lambda *g: (0,)),
        pl.BlockSpec((None, pt.shape[1]), lambda *g: (g[0], 0)),
        pl.BlockSpec((None, grouped), lambda *g: (g[0], g[2])),
        pl.BlockSpec((None, None, grouped, dh), lambda *g: (g[0], g[1], g[2], 0)),
        (pl.BlockSpec((num_layers, None, num_pages, ps, dh), lambda *g: (0, g[1], 0, 0, 0)),) * 2,  # K and V pages
    ]
    args = (jnp.reshape(layer, (1,)).astype(jnp.int32), pt, row_pos, qh, (k_pages, v_pages))
    out_shape = [jax.ShapeDtypeStruct(qh.shape, q.dtype), jax.ShapeDtypeStruct(qh.shape[:3], F32)]
    if in_kernel:
        # Many query tiles (the learner's rows, long prefill chunks): enough programs without a
        # program per split, so each merges its splits itself (_fused_kernel: the same bits).
        out, lse = pl.pallas_call(
            functools.partial(_fused_kernel, **kernel_args),
            name="attention_fused",
            grid=(b, hkv, tp // bq // tiles),
            in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((None, None, grouped, dh), lambda i, h, j: (i, h, j, 0)),
                pl.BlockSpec((None, None, grouped), lambda i, h, j: (i, h, j)),
            ],
            out_shape=out_shape,
            compiler_params=compiler_params(warps, config.num_stages),
            interpret=interpret,
        )(*args)
    else:
        out, lse = _split_and_merge(
            args, in_specs, kernel_args, (b, hkv, tp, bq, g, tiles, splits), out_shape, config, interpret
        )
    out = out.reshape(b, hkv, tp, g, dh).transpose(0, 2, 1, 3, 4).reshape(b, tp, hq, dh)[:, :t]
    return out, lse.reshape(b, hkv, tp, g).transpose(0, 2, 1, 3).reshape(b, tp, hq)[:, :t]


def _split_and_merge(args, in_specs, kernel_args, dims, out_shape, config, interpret):
    """One program per (group of query tiles, KV split), then one per tile merging its splits
    (decode parallelism: a decode step's one tile still gets batch x KV heads x splits programs)."""
    b, hkv, tp, bq, g, tiles, splits = dims
    rows = bq * g
    grouped, dh = rows * tiles, args[3].shape[-1]

    def part(*blk):  # one (tile group, split) of a split output
        return pl.BlockSpec((None, None, None, grouped, *blk), lambda i, h, j, s: (i, h, s, j, *[0] * len(blk)))

    acc, m, l = pl.pallas_call(
        functools.partial(_kernel, **kernel_args),
        name="attention_split",
        grid=(b, hkv, tp // bq // tiles, splits),
        in_specs=in_specs,
        out_specs=[part(dh), part(), part()],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, splits, tp * g, dh), F32)]
        + [jax.ShapeDtypeStruct((b, hkv, splits, tp * g), F32)] * 2,
        compiler_params=compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
    )(*args)
    # The merge: one program per (tile, block of head-dim columns). The merge is elementwise in
    # the columns, so more, narrower programs only shorten each program's serial walk over the
    # splits' states (a decode step at batch 1 has just KV heads x tiles of them otherwise).
    bd = min(config.merge_block_d, dh)
    acc_spec = pl.BlockSpec((None, None, splits, rows, bd), lambda i, h, j, d: (i, h, 0, j, d))
    stat_spec = pl.BlockSpec((None, None, splits, rows), lambda i, h, j, d: (i, h, 0, j))
    return pl.pallas_call(
        functools.partial(_merge_kernel, kv_split=config.kv_split, prefetch=min(config.merge_prefetch, splits)),
        name="attention_merge",
        grid=(b, hkv, tp // bq, dh // bd),
        in_specs=[pl.BlockSpec((None, rows), lambda i, h, j, d: (i, j)), acc_spec, stat_spec, stat_spec],
        out_specs=[
            pl.BlockSpec((None, None, rows, bd), lambda i, h, j, d: (i, h, j, d)),
            pl.BlockSpec((None, None, rows), lambda i, h, j, d: (i, h, j)),
        ],
        out_shape=out_shape,
        compiler_params=compiler_params(config.merge_warps, 1),
        interpret=interpret,
    )(args[2], acc, m, l)


def _check(q, k, v, k_pages, v_pages, plan: Plan):
    if k_pages.ndim != 5:
        raise ValueError(f"KV cache must be [layers, Hkv, pages, page_size, Dh], got {k_pages.shape}")
    b, t, hq, dh = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != dh:
        raise ValueError(f"attention shapes do not match: q {q.shape}, k {k.shape}, v {v.shape}")
    if k_pages.shape != v_pages.shape or k_pages.shape[1] != k.shape[2] or k_pages.shape[4] != dh:
        raise ValueError(f"KV cache shape {k_pages.shape} does not fit k {k.shape}")
    if hq % k.shape[2]:
        raise ValueError(f"{hq} query heads are not a multiple of {k.shape[2]} KV heads")
    if plan.positions.shape != (b, t) or plan.page_table.shape[0] != b:
        raise ValueError(
            f"positions {plan.positions.shape} / page_table {plan.page_table.shape} do not match batch {b}, tokens {t}"
        )


def _forward(q, k, v, kv_pages, layer, plan: Plan, config: AttentionConfig, interpret: bool):
    """(out, lse [B, T, Hq], (k_pages, v_pages)): the cache written, then attended."""
    k_pages, v_pages = kv_pages
    _check(q, k, v, k_pages, v_pages, plan)
    k_pages = write_kv(k_pages, k, layer, plan)
    v_pages = write_kv(v_pages, v, layer, plan)
    return *padded_attention(q, k_pages, v_pages, layer, plan, config, interpret), (k_pages, v_pages)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def paged_attention(q, k, v, kv_pages, layer, plan: Plan, config: AttentionConfig, interpret: bool):
    """q [B, T, Hq, Dh], this call's k, v [B, T, Hkv, Dh], kv_pages: (k_pages, v_pages) [L, Hkv, pages,
    page_size, Dh] -> (out [B, T, Hq, Dh], kv_pages with k, v written into layer `layer`).
    plan: `plan(page_table, positions, Hq // Hkv, page_size, config)`, made once per forward."""
    out, _, kv_pages = _forward(q, k, v, kv_pages, layer, plan, config, interpret)
    return out, kv_pages


def _fwd(q, k, v, kv_pages, layer, plan, config, interpret):
    out, lse, kv_pages = _forward(q, k, v, kv_pages, layer, plan, config, interpret)
    saved = (q, k, v, out, lse) if config.backward else (q, k, v, None, None)
    return (out, kv_pages), (*saved, plan.positions)


def _bwd(config, interpret, saved, cotangents):
    # Gradients are defined for the learner's pass: whole sequences into fresh pages, so every key a
    # query sees was written by this call and dense causal attention over (q, k, v) is the same
    # function. Deterministic, not bitwise-promised: XLA's vjp of the dense reference, or the
    # Pallas flash backward (fixed loop orders, no atomics) with the forward's log-sum-exp.
    q, k, v, out, lse, positions = saved
    if config.backward is not None:
        dq, dk, dv = attention_bwd(q, k, v, (out, lse), cotangents[0], positions, config.backward, interpret)
    else:
        _, vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, positions), q, k, v)
        dq, dk, dv = vjp(cotangents[0])
    return dq, dk, dv, None, None, None


paged_attention.defvjp(_fwd, _bwd)


def dense_attention(q, k, v, positions):
    """Causal GQA attention where every visible key is among this call's tokens (positions mask)."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    acc = acc_dtype(q.dtype)
    s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=acc) / math.sqrt(q.shape[3])
    visible = (positions[:, None, :] <= positions[:, :, None]) & (positions[:, None, :] >= 0)
    s = jnp.where(visible[:, None], s, -jnp.inf)
    m = jnp.max(s, axis=3, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(p, axis=3, keepdims=True)
    p = jnp.where(l > 0, p / jnp.where(l > 0, l, 1.0), 0.0)
    return jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v, preferred_element_type=acc).astype(q.dtype)


# Queries per stock-XLA attention call: its fp32 scores and probabilities are [B, Hq, queries, keys] each, so a
# whole row of 16,384 tokens at Qwen3-8B's heads compiles to 64 GiB of temporaries; chunks of 2,048 to 8.2 GiB.
REFERENCE_QUERY_CHUNK = 2048


def paged_attention_reference(q, k, v, kv_pages, layer, plan: Plan):
    """Stock XLA attention over the gathered pages: what `numerics="fast"` runs (plan made with config None).
    Rows of more than REFERENCE_QUERY_CHUNK queries are split into equal chunks (where T divides evenly), each an
    XLA attention call over all the keys: a query's row of scores is the same computation either way."""
    k_pages, v_pages = kv_pages
    _check(q, k, v, k_pages, v_pages, plan)
    k_pages = write_kv(k_pages, k, layer, plan)
    v_pages = write_kv(v_pages, v, layer, plan)
    page_table, positions = plan.page_table, plan.positions
    _, hkv, _, ps, dh = k_pages.shape
    b, p = page_table.shape
    keys = k_pages[layer][:, page_table].reshape(hkv, b, p * ps, dh).transpose(1, 2, 0, 3)
    vals = v_pages[layer][:, page_table].reshape(hkv, b, p * ps, dh).transpose(1, 2, 0, 3)
    key_pos = jnp.arange(p * ps)

    def attend(q, positions):
        mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, S]
        return jax.nn.dot_product_attention(q, keys, vals, mask=mask, implementation="xla")

    t = q.shape[1]
    chunks = -(-t // REFERENCE_QUERY_CHUNK)
    if chunks > 1 and t % chunks == 0:
        split = lambda x: x.reshape(b, chunks, t // chunks, *x.shape[2:]).swapaxes(0, 1)  # noqa: E731
        # checkpointed: a gradient recomputes each chunk's probabilities rather than keeping every chunk's
        out = jax.lax.map(jax.checkpoint(lambda qp: attend(*qp)), (split(q), split(positions)))
        out = out.swapaxes(0, 1).reshape(q.shape)
    else:
        out = attend(q, positions)
    valid = (positions >= 0)[:, :, None, None]
    return jnp.where(valid, out, jnp.zeros_like(out)), (k_pages, v_pages)
