"""The strict numerics contract in one place: per-op precision, tile configs, XLA flags, and the
two op sets (`strict`: our Pallas kernels; `fast`: plain XLA, the path a JAX user gets).

Same hardware + same software + same tile configs = same bits, whatever the batch, chunking or
position in the batch. Change a config below and every logprob may change (consistently on both
sides, since sampler and learner read the same table).
"""

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Literal, NamedTuple

from pallas_kernels import attention, attention_bwd, logprob, matmul, rmsnorm, swiglu, truncation
from pallas_kernels._common import interpret_mode

Numerics = Literal["strict", "fast"]

# op: (inputs, accumulate / statistics, output). "act" = the model dtype (bf16, or fp32 in tests).
PRECISION = {
    "matmul": ("act", "fp32 acc, K ascending", "act; + residual in fp32, rounded to act"),
    "rmsnorm": (
        "act",
        "fp32 squares: D chunks added elementwise ascending, then one reduce",
        "act (normalise, round, scale, round)",
    ),
    "rope": ("act (rounded norm output) + fp32 tables", "fp32", "act"),
    "attention": (
        "act q/k/v",
        "fp32 scores, fp32 online softmax over KV blocks of block_pages pages ascending (pages maxed and"
        " exp-summed elementwise in order, one row reduce); p rounded to act for p@v, added page by page",
        "act",
    ),
    "swiglu": ("act", "fp32", "act (silu rounded, then product rounded)"),
    "logprob": ("act hidden + lm_head", "fp32 logits / T, fp32 running max/sum over vocab tiles ascending", "fp32"),
}

# Matmul tiles per shape class. Nothing here changes a row's bits: compiled, each output's K
# accumulation is one ascending chain whatever the tile (measured on the H200 for every M/N/K tile,
# warp and stage count tried: bench.speed's sweep, tests/test_kernels.py
# `test_matmul_tile_configs_agree` run compiled); interpreted, a tile walks K in 32-wide dots
# whatever block_k is. Decode rows get GEMV-like tiles (16 rows, narrow N tiles so even a
# 1024-wide output spreads over the GPU, long K tiles, 6 stages in flight: 8-18% faster than 4 at
# 8B decode shapes on the H200, bench.speed --only sweep); 65-256 rows (batch-256 decode, short
# prefill chunks) 64x128x128 with 4 stages (1.25-1.4x 64x64x128 at 256 rows of the 8B projections, the
# fastest of 10 tiles timed, 2026-11-30 sweep on the H200); the
# learner gets 128x256x64 tensor-core tiles (1.4x the 128x128x128 rate at 8192x4096x12288).
MATMUL_BLOCK_K = 128
MATMUL_DECODE = matmul.MatmulConfig(block_m=16, block_n=32, block_k=MATMUL_BLOCK_K, num_warps=4, num_stages=6)
MATMUL_SMALL = matmul.MatmulConfig(block_m=64, block_n=32, block_k=MATMUL_BLOCK_K, num_warps=4, num_stages=4)
MATMUL_MEDIUM = matmul.MatmulConfig(block_m=64, block_n=128, block_k=MATMUL_BLOCK_K, num_warps=4, num_stages=4)
MATMUL = matmul.MatmulConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)


# The matmul backward reads dy, w and x in place (MatmulConfig.backward_in_place) instead of
# multiplying transposed copies: learner 34.9 -> 38.0% MFU at Qwen3-1.7B x 8 x 1024, 37.2 -> 40.1% at
# 4B (H200, 2026-11-30, bench.speed --learner-copies side by side). Forward bits are unchanged.
MATMUL_BACKWARD_IN_PLACE = True


def matmul_config(rows: int) -> matmul.MatmulConfig:
    """The tile config for a call with `rows` rows (a static shape, so chosen at trace time)."""
    c = MATMUL_DECODE if rows <= 16 else MATMUL_SMALL if rows <= 64 else MATMUL_MEDIUM if rows <= 256 else MATMUL
    return dataclasses.replace(c, backward_in_place=True) if MATMUL_BACKWARD_IN_PLACE else c


def set_matmul_backward(in_place: bool) -> None:
    """The matmuls' gradient: kernels that read the operands in place (default) or transposed copies
    through the forward kernel. Forward bits are the same either way. Takes effect for functions
    traced afterwards."""
    global MATMUL_BACKWARD_IN_PLACE
    MATMUL_BACKWARD_IN_PLACE = in_place


def logprob_config() -> logprob.LogprobConfig:
    """LOGPROB, its backward's matmuls reading their operands in place as the layers' do (or not:
    set_matmul_backward). Forward bits are the same either way."""
    return dataclasses.replace(
        LOGPROB, backward=dataclasses.replace(LOGPROB.backward, backward_in_place=MATMUL_BACKWARD_IN_PLACE)
    )


def rmsnorm_config(cos) -> rmsnorm.RMSNormConfig:
    """Hidden-size norms (no RoPE) or the per-head q/k norms (RoPE tables given)."""
    return RMSNORM if cos is None else RMSNORM_HEADS


def padded_rows(rows: int, numerics: "Numerics") -> int:
    """Rows the strict forward carries its activations at: a multiple of the matmul tile height of
    `rows`' class (16 for decode), so no kernel pads or slices per call (a decode step of one row
    spent ~5% of its time in pad/slice copies around every matmul and norm). Rows are independent
    in every kernel, so padding never changes a real row's bits. The fast path pads nothing."""
    if numerics == "fast":
        return rows
    block = matmul_config(rows).block_m
    return -(-rows // block) * block


# RMSNorm: one row per program for the hidden-size norms (a decode step's single real row was one
# program walking 16 padded rows: 21 us per call at 4096 wide on the H200, 73 calls a step); the
# per-head q/k norms (+RoPE, 128 wide, heads x tokens rows) keep 16-row programs. The row tile
# sets the reduction layout on the GPU, so each kind has one config on both sides.
RMSNORM = rmsnorm.RMSNormConfig(block_rows=1, block_d=1024, num_warps=4)
RMSNORM_HEADS = rmsnorm.RMSNormConfig(block_rows=16, block_d=256, num_warps=4)
SWIGLU = swiglu.SwiGLUConfig(block_rows=16, block_cols=128, num_warps=4)
# Attention: 4 pages (64 keys) per online-softmax step: a decode step's attention was a chain of
# one-page steps (19 us per layer at 8B, batch 1, context 512 on the H200 for 1 MB of KV).
# The learner's attention gradient: the Pallas flash backward (pallas_kernels/attention_bwd.py). XLA's
# dense backward (backward=None) holds [B, H, T, T] fp32 arrays and runs XLA dots, whose algorithm
# XLA's autotuner picks per compilation by timing: two processes training on the same two H200s got
# gradients that differed in the last bits (2026-11-30), and the flash backward has no XLA dot.
# Forward programs: 2 warps and 2 query tiles per program (where a call has 2): the learner's
# attention at Qwen3-4B x 2 x 4096 tokens 4.06 -> 2.80 ms a layer, 8 x 1024 1.37 -> 1.02 ms, a
# decode step at batch 64 x 2048 (8B heads) 373 -> 299 us (H200, 2026-11-30, bench.speed --only
# sweep --sweep attention). Neither changes a bit (tests/test_kernels.py
# test_attention_tiles_per_program_agree, compiled: 1-8 tiles, 2-8 warps); 1 warp does. Calls of 8
# or more query tiles per row merge their KV splits inside the attention kernel
# (AttentionConfig.merge_in_kernel_from: the same bits): the learner's attention at 4B x 2 x 4096
# 2.85 -> 2.59 ms a layer (H200, 2026-11-30).
ATTENTION = attention.AttentionConfig(
    page_size=16,
    block_rows=16,
    kv_split=256,
    num_warps=2,
    num_stages=2,
    block_pages=4,
    tiles=2,
    backward=attention_bwd.AttentionBwdConfig(),
)


def set_attention_backward(flash: bool) -> None:
    """The learner's attention gradient: the Pallas flash backward (default) or XLA's dense one (to
    compare speed and memory). Forward bits are the same either way (only the backward changes).
    Takes effect for functions traced afterwards."""
    global ATTENTION
    ATTENTION = dataclasses.replace(ATTENTION, backward=attention_bwd.AttentionBwdConfig() if flash else None)


LOGPROB = logprob.LogprobConfig(
    block_rows=64, block_vocab=128, block_k=64, vocab_splits=128, num_warps=4, num_stages=4, backward=MATMUL
)
# 4 stages: a decode step streams the 1.24 GB lm_head (8B) through 128 programs, one per SM, and 2
# stages in flight held it at 44% of the copy bandwidth.
# One LOGPROB config for every row count: block_rows changes the layout of the [rows, vocab tile]
# reductions (max, sum of exp) and with it their order, so a row's bits depend on it (measured on
# the H200 and in interpret mode: 16- vs 64-row programs differ in the last bit for some rows).
# A decode step reads the lm_head once anyway: row blocks of one vocab range run next to each
# other (rows are the fastest grid axis) and share it through L2.
PAGE_SIZE = ATTENTION.page_size  # the fast path uses the same cache layout

# XLA must not keep excess precision between ops or drop roundings we asked for.
STRICT_XLA_FLAGS = ("--xla_allow_excess_precision=false",)


_started_without_flags = False  # XLA's backend was already up, without our flags, when rlkjax was imported


def _backend_started() -> bool:
    from jax._src import xla_bridge  # private, but the only way to ask; absent -> assume not started

    return getattr(xla_bridge, "backends_are_initialized", lambda: False)()


def _missing_flags() -> list[str]:
    flags = os.environ.get("XLA_FLAGS", "").split()
    return [f for f in STRICT_XLA_FLAGS if f not in flags]


def set_xla_flags() -> None:
    """Add the strict flags to XLA_FLAGS. XLA reads them once, when it starts its backend: if that
    already happened (JAX used before `import rlkjax`), remember it so strict mode refuses to run."""
    global _started_without_flags
    missing = _missing_flags()
    if missing:
        _started_without_flags = _started_without_flags or _backend_started()
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *missing]).strip()


def check_xla_flags() -> None:
    """Raise unless XLA runs (or will start) with the strict flags."""
    if _started_without_flags:
        raise RuntimeError(
            f"strict numerics need XLA started with XLA_FLAGS containing {list(STRICT_XLA_FLAGS)}, but JAX "
            "had started its backend before rlkjax was imported: import rlkjax first, or set XLA_FLAGS yourself"
        )
    missing = _missing_flags()
    if missing:
        raise RuntimeError(f"strict numerics need XLA_FLAGS to contain {missing} (it was changed after rlkjax set it)")


class Ops(NamedTuple):
    matmul: Callable  # (x, w, residual=None)
    matmul_layer: Callable  # (x, w_stacked [L, N, K], layer, residual=None): reads w[layer] in place
    # (x, w[layer], w_stacked, layer, residual=None): differentiable through w[layer], reads w_stacked in place
    matmul_in_place: Callable
    matmul_layer_fused: Callable  # (x, (w_stacked, ...), layer) -> (x @ w[layer].T, ...) in one launch
    rmsnorm: Callable  # (x, weight, cos, sin, eps)
    rmsnorm_layer: Callable  # (x, weights_stacked [L, D], layer, cos, sin, eps): reads weights[layer] in place
    swiglu: Callable  # (gate, up)
    attention_plan: Callable  # (page_table, positions, group) -> the index arrays every layer's attention reads
    attention: Callable  # (q, k, v, k_pages, v_pages, layer, plan) -> (out, k_pages, v_pages)
    token_logprobs: Callable  # (h, w, targets, temperature)
    sample_tokens: Callable  # (h, w, seeds, steps, temperature) -> (tokens, logprobs)
    # (h, w, seeds, steps, temperature, k) -> (tokens, logprobs, top_ids [N, k], top_logprobs [N, k])
    sample_tokens_with_alternatives: Callable
    token_logprobs_with_alternatives: Callable  # (h, w, targets, temperature, k) -> (logprobs, top_ids, top_logprobs)
    # (h, w, seeds, steps, temperature, top_k, top_p, min_p, k) -> (tokens, logprobs, renormalised logprobs[, alts])
    sample_tokens_truncated: Callable
    # (h, w, targets, temperature, top_k, top_p, min_p) -> (logprobs, renormalised logprobs)
    token_logprobs_truncated: Callable


@functools.cache
def ops(numerics: Numerics) -> Ops:
    if numerics == "fast":
        return Ops(
            lambda x, w, r=None: matmul.matmul_reference(x, w, r),
            lambda x, w, layer, r=None: matmul.matmul_reference(x, w[layer], r),
            lambda x, w_layer, w, layer, r=None: matmul.matmul_reference(x, w_layer, r),
            lambda x, ws, layer: tuple(matmul.matmul_reference(x, w[layer]) for w in ws),
            rmsnorm.rmsnorm_reference,
            lambda x, w, layer, cos, sin, eps: rmsnorm.rmsnorm_reference(x, w[layer], cos, sin, eps),
            swiglu.swiglu_reference,
            lambda pt, pos, g: attention.plan(pt, pos, g, PAGE_SIZE),
            attention.paged_attention_reference,
            logprob.token_logprobs_reference,
            logprob.sample_tokens_reference,
            logprob.sample_tokens_with_alternatives_reference,
            logprob.token_logprobs_with_alternatives_reference,
            truncation.sample_tokens_truncated_reference,
            truncation.token_logprobs_truncated_reference,
        )
    if numerics != "strict":
        raise ValueError(f"numerics={numerics!r} must be 'strict' or 'fast'")
    check_xla_flags()
    interp = interpret_mode()
    return Ops(
        lambda x, w, r=None: matmul.matmul(x, w, r, matmul_config(x.shape[0]), interp),
        lambda x, w, layer, r=None: matmul.matmul_layer(x, w, layer, r, matmul_config(x.shape[0]), interp),
        lambda x, wl, w, i, r=None: matmul.matmul_in_place(x, wl, w, i, r, matmul_config(x.shape[0]), interp),
        lambda x, ws, layer: matmul.matmul_layer_fused(x, ws, layer, matmul_config(x.shape[0]), interp),
        lambda x, w, cos, sin, eps: rmsnorm.rmsnorm(x, w, cos, sin, eps, rmsnorm_config(cos), interp),
        lambda x, w, i, cos, sin, eps: rmsnorm.rmsnorm_layer(x, w, i, cos, sin, eps, rmsnorm_config(cos), interp),
        lambda g, u: swiglu.swiglu(g, u, SWIGLU, interp),
        lambda pt, pos, g: attention.plan(pt, pos, g, ATTENTION.page_size, ATTENTION),
        lambda *a: attention.paged_attention(*a, ATTENTION, interp),
        lambda h, w, t, temp: logprob.token_logprobs(h, w, t, temp, logprob_config(), interp),
        lambda h, w, s, st, temp: logprob.sample_tokens(h, w, s, st, temp, LOGPROB, interp),
        lambda h, w, s, st, temp, k: logprob.sample_tokens_with_alternatives(h, w, s, st, temp, k, LOGPROB, interp),
        lambda h, w, t, temp, k: logprob.token_logprobs_with_alternatives(h, w, t, temp, k, LOGPROB, interp),
        lambda *a: truncation.sample_tokens_truncated(*a, LOGPROB, interp),
        lambda *a: truncation.token_logprobs_truncated(*a, LOGPROB, interp),
    )
