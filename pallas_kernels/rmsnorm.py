"""RMSNorm over rows, optionally followed by RoPE (Qwen3's per-head q/k norm feeds RoPE directly).

x [N, D], weight [D]; with rope, cos/sin [N, D/2] (float32 tables gathered per row) and the
half-split layout (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). Rounding points follow the HF
model: normalise in fp32, round to x.dtype, scale by the weight, round again; RoPE is computed
in fp32 from the rounded norm output and rounded once.

The sum of squares adds D's `block_d`-wide chunks elementwise in ascending order, then reduces
the chunk-wide partial once; each program owns `block_rows` whole rows, so a row's bits never
depend on which other rows share its program. `block_rows` is part of the contract (the tile's
shape sets the reduction's layout on the GPU), so every caller uses one config.
`rmsnorm_layer` reads one layer's weight out of a stacked [L, D] array in place (a `lax.scan`
slice would copy it: ~2 us per norm per layer in a decode step).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _math
from pallas_kernels.common import F32, acc_dtype, check_block, compiler_params, pad_dim


@dataclasses.dataclass(frozen=True)
class RMSNormConfig:
    block_rows: int = 16
    block_d: int = 256
    num_warps: int = 4
    # The backward (`_bwd_kernel`): rows per program and feature chunk. Each program writes one
    # partial sum of the weight's gradient over its rows, so the rows set how many partials XLA
    # adds up after; gradients are not part of the bitwise contract, so this is free to tune.
    backward_rows: int = 16
    backward_block_d: int = 256

    def __post_init__(self):
        check_block("block_rows", self.block_rows, minimum=1)
        check_block("block_d", self.block_d)
        check_block("backward_rows", self.backward_rows)
        check_block("backward_block_d", self.backward_block_d)
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")


def _norm(x, inv, w, dtype):
    acc = acc_dtype(dtype)
    n = (x.astype(acc) * inv).astype(dtype)
    return (w.astype(acc) * n.astype(acc)).astype(dtype)


def _kernel(*refs, eps, block_d, d, rope, width, stacked):
    if stacked:
        layer_ref, x_ref, w_ref, *refs = refs
        layer = layer_ref[0]
        w_at = lambda c: w_ref[layer, c]  # noqa: E731
    else:
        x_ref, w_ref, *refs = refs
        w_at = lambda c: w_ref[c]  # noqa: E731
    o_ref = refs[-1]
    chunks = [pl.ds(i, block_d) for i in range(0, d, block_d)]
    # Squares summed elementwise over the chunks (ascending), then ONE row reduction: the order
    # is part of the contract. (A row reduction per chunk made every chunk wait for a cross-warp
    # reduce: 28 us for one 4096-wide decode row on the H200, a fifth of a decode step.)
    sq = jnp.zeros((x_ref.shape[0], block_d), F32)
    for c in chunks:
        xc = x_ref[:, c].astype(F32)
        sq = sq + xc * xc
    sumsq = jnp.sum(sq, axis=1)
    inv = _math.rsqrt(sumsq / width + eps)[:, None]  # width: the true feature count (d may be padded)
    if not rope:
        for c in chunks:
            o_ref[:, c] = _norm(x_ref[:, c], inv, w_at(c), o_ref.dtype)
        return
    cos, sin = refs[0][...], refs[1][...]
    lo, hi = pl.ds(0, d // 2), pl.ds(d // 2, d // 2)
    x1 = _norm(x_ref[:, lo], inv, w_at(lo), o_ref.dtype).astype(F32)
    x2 = _norm(x_ref[:, hi], inv, w_at(hi), o_ref.dtype).astype(F32)
    o_ref[:, lo] = (x1 * cos - x2 * sin).astype(o_ref.dtype)
    o_ref[:, hi] = (x2 * cos + x1 * sin).astype(o_ref.dtype)


def _pad_halves(a, half_width):
    """[..., 2h] -> [..., 2 * half_width] laid out [a1, 0, a2, 0]: RoPE's halves stay aligned."""
    h = a.shape[-1] // 2
    return jnp.concatenate([pad_dim(a[..., :h], -1, half_width), pad_dim(a[..., h:], -1, half_width)], axis=-1)


def _feature_padding(width, rope, block_d):
    """Triton blocks are powers of two: a width that is not a whole number of them gets zero
    features (exact zeros in the sum of squares; the mean divides by the true width), sliced away
    after. With RoPE each half is padded on its own ([x1, 0, x2, 0]), so x1, x2, cos and sin stay
    lined up. Returns (pad features, pad cos/sin, unpad), or None where the width needs none."""
    if rope:
        half = pl.next_power_of_2(width // 2)
        if half == width // 2:
            return None
        unpad = lambda a: jnp.concatenate([a[..., : width // 2], a[..., half : half + width // 2]], axis=-1)  # noqa: E731
        return (lambda a: _pad_halves(a, half)), (lambda t: pad_dim(t, 1, half)), unpad
    chunk = min(block_d, pl.next_power_of_2(width))
    if width % chunk == 0:
        return None
    return (lambda a: pad_dim(a, -1, chunk)), None, (lambda a: a[..., :width])


def _padded_rmsnorm(x, w, cos, sin, eps, config, interpret, layer=None):
    """`_pallas_rmsnorm` on the padded layout (`_feature_padding`). w [D], or stacked [L, D] with
    `layer`: read in place, or sliced (a copy) where it is padded."""
    padding = _feature_padding(x.shape[1], cos is not None, config.block_d)
    if padding is None:
        return _pallas_rmsnorm(x, w, cos, sin, eps, config, interpret, layer=layer)
    pad, pad_table, unpad = padding
    width, x = x.shape[1], pad(x)
    w = pad(w if layer is None else jax.lax.dynamic_index_in_dim(w, layer, keepdims=False))
    if cos is not None:
        cos, sin = pad_table(cos), pad_table(sin)
    return unpad(_pallas_rmsnorm(x, w, cos, sin, eps, config, interpret, width=width))


def _pallas_rmsnorm(x, w, cos, sin, eps, config, interpret, *, width=None, layer=None):
    """w [D], or w [L, D] with `layer` (read in place)."""
    n, d = x.shape
    rope = cos is not None
    block_d = d // 2 if rope else min(config.block_d, d)
    check_block("feature chunk", block_d, minimum=1)
    if d % block_d:
        raise ValueError(f"rmsnorm width {d} is not a multiple of block_d={block_d}")
    br = config.block_rows
    x = pad_dim(x, 0, br)
    args = [x, w]
    specs = [pl.BlockSpec((br, d), lambda i: (i, 0)), pl.BlockSpec((d,), lambda i: (0,))]
    if layer is not None:
        args = [jnp.reshape(layer, (1,)).astype(jnp.int32), *args]
        specs = [pl.BlockSpec((1,), lambda i: (0,)), specs[0], pl.BlockSpec(w.shape, lambda i: (0, 0))]
    if rope:
        args += [pad_dim(cos, 0, br), pad_dim(sin, 0, br)]
        specs += [pl.BlockSpec((br, d // 2), lambda i: (i, 0))] * 2
    y = pl.pallas_call(
        functools.partial(
            _kernel, eps=eps, block_d=block_d, d=d, rope=rope, width=width or d, stacked=layer is not None
        ),
        name="rmsnorm",
        grid=(x.shape[0] // br,),
        in_specs=specs,
        out_specs=pl.BlockSpec((br, d), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=compiler_params(config.num_warps, 1),
        interpret=interpret,
    )(*args)
    return y[:n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def rmsnorm(x, weight, cos, sin, eps: float, config: RMSNormConfig, interpret: bool):
    """RMSNorm(x) * weight, then RoPE if cos/sin are given (else pass None for both)."""
    if x.ndim != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rmsnorm shapes do not match: x {x.shape}, weight {weight.shape}")
    return _padded_rmsnorm(x, weight, cos, sin, eps, config, interpret)


def _fwd(x, weight, cos, sin, eps, config, interpret):
    return rmsnorm(x, weight, cos, sin, eps, config, interpret), (x, weight, cos, sin)


def _bwd_kernel(*refs, eps, block_d, d, rope, width):
    """dx and this program's partial sum of dw for `backward_rows` rows. With n = x * inv (rounded
    as the forward rounds it) and a = w * n: da = dy (through RoPE's rotation when there is one),
    dw = sum over rows of da * n, and dx = inv * (da w) - x * inv^3 * sum(da w x) / width. fp32
    throughout, one rounding per output. Two passes over the feature chunks: the row sums, then
    the outputs (a 4096-wide row of 16 rows does not fit in registers at once)."""
    if rope:
        x_ref, w_ref, dy_ref, cos_ref, sin_ref, dx_ref, dw_ref = refs
        chunks = [pl.ds(0, d // 2), pl.ds(d // 2, d // 2)]
    else:
        x_ref, w_ref, dy_ref, dx_ref, dw_ref = refs
        chunks = [pl.ds(i, block_d) for i in range(0, d, block_d)]

    def load(i):  # chunk i: x and the gradient reaching w * n, in fp32
        c = chunks[i]
        if not rope:
            return c, x_ref[:, c].astype(F32), dy_ref[:, c].astype(F32)
        cos, sin = cos_ref[...], sin_ref[...]
        dy1, dy2 = dy_ref[:, chunks[0]].astype(F32), dy_ref[:, chunks[1]].astype(F32)
        da = dy1 * cos + dy2 * sin if i == 0 else dy2 * cos - dy1 * sin
        return c, x_ref[:, c].astype(F32), da

    rows = x_ref.shape[0]
    sq = jnp.zeros((rows, chunks[0].size), F32)
    dot = jnp.zeros((rows, chunks[0].size), F32)
    for i in range(len(chunks)):
        c, xc, da = load(i)
        sq = sq + xc * xc
        dot = dot + da * w_ref[c].astype(F32)[None, :] * xc
    inv = _math.rsqrt(jnp.sum(sq, axis=1) / width + eps)[:, None]
    coef = inv * inv * inv * (jnp.sum(dot, axis=1)[:, None] / width)
    for i in range(len(chunks)):
        c, xc, da = load(i)
        dx_ref[:, c] = (inv * da * w_ref[c].astype(F32)[None, :] - xc * coef).astype(dx_ref.dtype)
        n = (xc * inv).astype(x_ref.dtype).astype(F32)
        dw_ref[c] = jnp.sum(da * n, axis=0)


def _pallas_rmsnorm_bwd(x, w, cos, sin, dy, eps, config, interpret, *, width):
    """(dx [N, D], dw partial sums [programs, D] fp32) for D a whole number of chunks (or RoPE
    halves of a power of two). Padded rows are zero: dx 0, no share of dw."""
    d, rope = x.shape[1], cos is not None
    block_d = d // 2 if rope else min(config.backward_block_d, d)
    br = config.backward_rows
    n = x.shape[0]
    x, dy = pad_dim(x, 0, br), pad_dim(dy, 0, br)
    programs = x.shape[0] // br
    args = [x, w, dy]
    specs = [pl.BlockSpec((br, d), lambda i: (i, 0)), pl.BlockSpec((d,), lambda i: (0,))]
    specs.append(specs[0])
    if rope:
        args += [pad_dim(cos, 0, br), pad_dim(sin, 0, br)]
        specs += [pl.BlockSpec((br, d // 2), lambda i: (i, 0))] * 2
    dx, dw = pl.pallas_call(
        functools.partial(_bwd_kernel, eps=eps, block_d=block_d, d=d, rope=rope, width=width),
        name="rmsnorm_bwd",
        grid=(programs,),
        in_specs=specs,
        out_specs=[pl.BlockSpec((br, d), lambda i: (i, 0)), pl.BlockSpec((None, d), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((programs, d), F32)],
        compiler_params=compiler_params(config.num_warps, 1),
        interpret=interpret,
    )(*args)
    return dx[:n], dw


def _bwd(eps, config, interpret, saved, dy):
    """The Pallas backward on the forward's padded layout (`_feature_padding`); the weight's
    gradient is its programs' partial sums added by XLA (deterministic: no atomics). Not part of
    the bitwise contract; tested against a float64 evaluation. (It replaced jax.vjp of the
    reference, whose XLA reductions alone took 7.5 ms of a Qwen3-1.7B x 8192-token step on the
    H200; this kernel takes 5.7 ms there, ~57 us per hidden-size norm, with its two passes over
    x and dy at ~70% of the copy bandwidth: its rows and warps are untuned.)"""
    x, weight, cos, sin = saved
    width = x.shape[1]
    padding = _feature_padding(width, cos is not None, config.backward_block_d)
    if padding is None:
        dx, dw = _pallas_rmsnorm_bwd(x, weight, cos, sin, dy, eps, config, interpret, width=width)
    else:
        pad, pad_table, unpad = padding
        x, w = pad(x), pad(weight)
        if cos is not None:
            cos, sin = pad_table(cos), pad_table(sin)
        dx, dw = _pallas_rmsnorm_bwd(x, w, cos, sin, pad(dy), eps, config, interpret, width=width)
        dx, dw = unpad(dx), unpad(dw)
    return dx, jnp.sum(dw, axis=0).astype(weight.dtype), None, None


rmsnorm.defvjp(_fwd, _bwd)


def rmsnorm_layer(x, weights, layer, cos, sin, eps: float, config: RMSNormConfig, interpret: bool):
    """`rmsnorm(x, weights[layer], ...)`, same kernel and bits, reading the layer's weight out of the
    stacked weights [L, D] in place. Forward only (the sampler's path). A width the kernel would pad
    takes the slice instead: same bits, a copy."""
    if x.ndim != 2 or weights.ndim != 2 or weights.shape[1] != x.shape[1]:
        raise ValueError(f"rmsnorm_layer shapes do not match: x {x.shape}, weights {weights.shape}")
    return _padded_rmsnorm(x, weights, cos, sin, eps, config, interpret, layer)


def rmsnorm_reference(x, weight, cos, sin, eps, config=None, interpret=None):
    xf = x.astype(acc_dtype(x.dtype))
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=1, keepdims=True) + eps)
    y = _norm(x, inv, weight, x.dtype)
    if cos is None:
        return y
    x1, x2 = jnp.split(y.astype(acc_dtype(x.dtype)), 2, axis=1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=1).astype(x.dtype)
