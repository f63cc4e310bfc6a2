"""Matmul y = x @ w.T (+ residual): fixed ascending K order into one fp32 accumulator.

x [M, K], w [N, K] (HF Linear layout, [out, in]), optional residual [M, N]; y [M, N] in x.dtype.
`matmul_layer` takes every layer's weights stacked, w [L, N, K], and an int32 layer index, and
reads that layer in place: inside a `lax.scan` over layers, slicing the stack first would copy
each layer's weights before every call (measured 2.6x the weight traffic of a decode step).
Each output tile walks K in `block_k` steps in ascending order, so a row's bits do not depend on
M, on the row's place in its tile, or on what else is in the batch. The residual add (Qwen3's
`x + o_proj(...)`, `x + down_proj(...)`) happens in the epilogue, after the product is rounded
to the output dtype, as in the HF model.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels._common import F32, acc_dtype, check_block, compiler_params, dot_nt, pad_dim


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 3
    # The backward's dx = dy @ w and dw = dy.T @ x: False multiplies transposed copies of w, dy and
    # x with the forward kernel; True reads them where they lie (`_grad_product`), saving the copies
    # (~2 GB of traffic per layer at Qwen3-4B x 8192 tokens). Either way a fixed K order; the
    # gradients' bits may differ between the two. Opt-in until measured on the GPU.
    backward_in_place: bool = False

    def __post_init__(self):
        check_block("block_m", self.block_m)
        check_block("block_n", self.block_n)
        check_block("block_k", self.block_k)
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")


def _product(x_ref, w_tile, shape, block_k, k_steps, interpret):
    """The fp32 accumulator of one output tile: K in `block_k` steps, ascending."""

    def body(i, acc):
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        x, w = x_ref[:, ks], w_tile(ks)
        if interpret:
            # XLA:CPU runs a 128-wide bf16 x bf16 -> fp32 dot through a runtime call that does not
            # support it (seen under the 8-device shard_map of tests/test_sharding.py); 32-wide
            # sub-steps, accumulated in order, stay on its inline emitter and keep a row's bits
            # independent of the M/N tiles (an fp32 upcast would not: XLA:CPU's fp32 GEMM blocks
            # by shape). Compiled, the tile is one dot: Triton accumulates its K steps in order.
            for j in range(0, block_k, min(32, block_k)):
                sub = slice(j, j + min(32, block_k))
                acc = acc + dot_nt(x[:, sub], w[:, sub])
            return acc
        return acc + dot_nt(x, w)

    return jax.lax.fori_loop(0, k_steps, body, jnp.zeros(shape, F32))


def _kernel(*refs, block_k, k_steps, has_residual, stacked, interpret):
    if stacked:
        layer_ref, x_ref, w_ref, *refs = refs
        layer = layer_ref[0]
        w_tile = lambda ks: w_ref[layer, :, ks]  # noqa: E731
    else:
        x_ref, w_ref, *refs = refs
        w_tile = lambda ks: w_ref[:, ks]  # noqa: E731
    o_ref = refs[-1]
    acc = _product(x_ref, w_tile, o_ref.shape, block_k, k_steps, interpret)
    y = acc.astype(o_ref.dtype)
    if has_residual:
        y = (y.astype(F32) + refs[0][...].astype(F32)).astype(o_ref.dtype)
    o_ref[...] = y


def _pallas_matmul(x, w, residual, config: MatmulConfig, interpret: bool, layer=None, out_dtype=None):
    """w [N, K], or w [L, N, K] with `layer` (N and K then tile multiples: the stack is not padded).
    out_dtype: the result's type (default x.dtype); float32 keeps the accumulator unrounded."""
    c = config
    m, n = x.shape[0], w.shape[-2]
    x = pad_dim(pad_dim(x, 0, c.block_m), 1, c.block_k)
    mp, kp = x.shape
    if layer is None:
        w = pad_dim(pad_dim(w, 0, c.block_n), 1, c.block_k)
        args = [x, w]
        in_specs = [
            pl.BlockSpec((c.block_m, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((c.block_n, kp), lambda i, j: (j, 0)),
        ]
    else:
        args = [jnp.reshape(layer, (1,)).astype(jnp.int32), x, w]
        in_specs = [
            pl.BlockSpec((1,), lambda i, j: (0,)),
            pl.BlockSpec((c.block_m, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((w.shape[0], c.block_n, kp), lambda i, j: (0, j, 0)),
        ]
    np_ = w.shape[-2]
    if residual is not None:
        args.append(pad_dim(pad_dim(residual, 0, c.block_m), 1, c.block_n))
        in_specs.append(pl.BlockSpec((c.block_m, c.block_n), lambda i, j: (i, j)))
    y = pl.pallas_call(
        functools.partial(
            _kernel,
            block_k=c.block_k,
            k_steps=kp // c.block_k,
            has_residual=residual is not None,
            stacked=layer is not None,
            interpret=interpret,
        ),
        name=f"matmul_n{n}_k{kp}",  # named by shape: profiles tell the projections apart
        grid=(mp // c.block_m, np_ // c.block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((c.block_m, c.block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype or x.dtype),
        compiler_params=compiler_params(c.num_warps, c.num_stages),
        interpret=interpret,
    )(*args)
    return y[:m, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def matmul(x, w, residual, config: MatmulConfig, interpret: bool):
    """x [M, K] @ w [N, K].T (+ residual [M, N] or None) -> [M, N] in x.dtype."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul shapes do not match: x {x.shape}, w {w.shape}")
    return _pallas_matmul(x, w, residual, config, interpret)


def _fwd(x, w, residual, config, interpret):
    return matmul(x, w, residual, config, interpret), (x, w, residual is not None)


def _bwd(config, interpret, saved, dy):
    # A fixed K order either way: deterministic run to run (no atomics, no split-K).
    x, w, has_residual = saved
    if config.backward_in_place:
        dx = _grad_product(dy, w, "nn", config, interpret).astype(x.dtype)
        dw = _grad_product(dy.astype(x.dtype), x, "tn", config, interpret).astype(w.dtype)
    else:
        dx = _pallas_matmul(dy, w.T, None, config, interpret).astype(x.dtype)
        dw = _pallas_matmul(dy.T.astype(x.dtype), x.T, None, config, interpret).astype(w.dtype)
    return dx, dw, (dy if has_residual else None)


def _grad_kernel(*refs, a_k_axis, block_k, k_steps, stacked, interpret):
    """One output tile of a @ b ("nn": a [M, K], b [K, N]) or a.T @ b ("tn": a [K, M], b [K, N]):
    K in `block_k` steps, ascending, into one fp32 accumulator. stacked: b is [L, K, N], read at
    the layer in the first ref."""
    if stacked:
        layer_ref, a_ref, b_ref, o_ref = refs
        b_tile = lambda ks: b_ref[layer_ref[0], ks, :]  # noqa: E731
    else:
        a_ref, b_ref, o_ref = refs
        b_tile = lambda ks: b_ref[ks, :]  # noqa: E731
    dims = (((a_k_axis,), (0,)), ((), ()))
    precision = jax.lax.Precision.HIGHEST if a_ref.dtype == F32 else None  # fp32: no TF32 (as dot_nt)

    def body(i, acc):
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        a = a_ref[:, ks] if a_k_axis == 1 else a_ref[ks, :]
        b = b_tile(ks)
        if not interpret:  # one dot per K step (Triton's lowering has no `slice` of a loaded value)
            return acc + jax.lax.dot_general(a, b, dims, precision, preferred_element_type=F32)
        step = min(32, block_k)  # interpret: 32-wide sub-steps (see _product)
        for j in range(0, block_k, step):
            a_j = jax.lax.slice_in_dim(a, j, j + step, axis=a_k_axis)
            acc = acc + jax.lax.dot_general(a_j, b[j : j + step], dims, precision, preferred_element_type=F32)
        return acc

    o_ref[...] = jax.lax.fori_loop(0, k_steps, body, jnp.zeros(o_ref.shape, F32)).astype(o_ref.dtype)


def _grad_product(a, b, layout: str, config: MatmulConfig, interpret: bool, layer=None, out_dtype=None):
    """a @ b (layout "nn": a [M, K], b [K, N]) or a.T @ b ("tn": a [K, M], b [K, N]) -> [M, N] in
    out_dtype (default a.dtype), read in place: the backward's dx = dy @ w ("nn") and dw = dy.T @ x
    ("tn"). With `layer`, b is a stack [L, K, N] (K and N tile multiples) and layer `layer` of it is
    read in place."""
    c, a_k_axis = config, 1 if layout == "nn" else 0
    m, n = a.shape[1 - a_k_axis], b.shape[-1]
    a = pad_dim(pad_dim(a, 1 - a_k_axis, c.block_m), a_k_axis, c.block_k)
    if layer is None:
        b = pad_dim(pad_dim(b, 0, c.block_k), 1, c.block_n)
    kp, mp, np_ = b.shape[-2], a.shape[1 - a_k_axis], b.shape[-1]
    a_block = (c.block_m, kp) if layout == "nn" else (kp, c.block_m)
    in_specs = [pl.BlockSpec(a_block, (lambda i, j: (i, 0)) if layout == "nn" else (lambda i, j: (0, i)))]
    args = [a, b]
    if layer is None:
        in_specs.append(pl.BlockSpec((kp, c.block_n), lambda i, j: (0, j)))
    else:
        in_specs = [pl.BlockSpec((1,), lambda i, j: (0,)), *in_specs]
        in_specs.append(pl.BlockSpec((b.shape[0], kp, c.block_n), lambda i, j: (0, 0, j)))
        args = [jnp.reshape(layer, (1,)).astype(jnp.int32), *args]
    y = pl.pallas_call(
        functools.partial(
            _grad_kernel,
            a_k_axis=a_k_axis,
            block_k=c.block_k,
            k_steps=kp // c.block_k,
            stacked=layer is not None,
            interpret=interpret,
        ),
        name=f"matmul_{layout}_n{n}_k{kp}",
        grid=(mp // c.block_m, np_ // c.block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((c.block_m, c.block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype or a.dtype),
        compiler_params=compiler_params(c.num_warps, c.num_stages),
        interpret=interpret,
    )(*args)
    return y[:m, :n]


matmul.defvjp(_fwd, _bwd)


def product(x, w, config: MatmulConfig, interpret: bool, out_dtype=None, layout: str = "nt"):
    """x [M, K] @ w [N, K].T ("nt"), x @ w with w [K, N] ("nn") or x.T @ w with x [K, M] ("tn") ->
    [M, N] in out_dtype (default x.dtype), not differentiable: the kernels for gradients computed by
    hand (the logprob head's backward), each in a fixed K order; "nn" and "tn" read their operands
    where they lie (the matmul backward's kernels), where "nt" on a transposed operand copies it."""
    if layout == "nt":
        return _pallas_matmul(x, w, None, config, interpret, out_dtype=out_dtype)
    return _grad_product(x, w, layout, config, interpret, out_dtype=out_dtype)


def matmul_layer(x, w, layer, residual, config: MatmulConfig, interpret: bool):
    """x [M, K] @ w[layer].T (+ residual) for stacked weights w [L, N, K]: the same kernel and the
    same bits as `matmul(x, w[layer], ...)`, without copying the layer out of the stack first.
    Forward only (the sampler's path; the learner differentiates `matmul` on sliced layers).
    Shapes that are not tile multiples take the slice (and pad) instead: same bits, a copy."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"matmul_layer shapes do not match: x {x.shape}, w {w.shape}")
    if w.shape[1] % config.block_n or w.shape[2] % config.block_k:
        return _pallas_matmul(x, jax.lax.dynamic_index_in_dim(w, layer, keepdims=False), residual, config, interpret)
    return _pallas_matmul(x, w, residual, config, interpret, layer)


def _fits_stack(w, config: MatmulConfig) -> bool:
    """Whether the kernels can read layers of w [L, N, K] in place: N and K tile multiples for the
    forward (N by block_n, K by block_k) and for dx = dy @ w (N by block_k, K by block_n)."""
    n, k = w.shape[1:]
    return not (n % config.block_n or k % config.block_k or n % config.block_k or k % config.block_n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def matmul_in_place(x, w_layer, w, layer, residual, config: MatmulConfig, interpret: bool):
    """`matmul(x, w_layer, residual)` for w_layer = w[layer] of a stack w [L, N, K]: the same bits
    and the same gradient bits, with w read in place by the forward and by dx = dy @ w (no copy of
    the layer: a Pallas call takes each operand as a buffer of its own, so a slice is copied, 10
    times per layer and again in the backward at Qwen3-4B). w_layer is never read: it carries the
    gradient dw (the caller's slice of w, which XLA then drops from the forward); pass w through
    `jax.lax.stop_gradient` (its cotangent is not computed). Shapes the kernels cannot read in
    place (`_fits_stack`) use w_layer."""
    if not _fits_stack(w, config):
        return matmul(x, w_layer, residual, config, interpret)
    return _pallas_matmul(x, w, residual, config, interpret, layer)


def _in_place_fwd(x, w_layer, w, layer, residual, config, interpret):
    out = matmul_in_place(x, w_layer, w, layer, residual, config, interpret)
    return out, (x, w_layer if not _fits_stack(w, config) else None, w, layer, residual is not None)


def _in_place_bwd(config, interpret, saved, dy):
    x, w_layer, w, layer, has_residual = saved
    if w_layer is not None or not config.backward_in_place:
        dx, dw, dr = _bwd(config, interpret, (x, w_layer if w_layer is not None else w[layer], has_residual), dy)
        return dx, dw, None, None, dr
    dx = _grad_product(dy, w, "nn", config, interpret, layer).astype(x.dtype)
    dw = _grad_product(dy.astype(x.dtype), x, "tn", config, interpret).astype(w.dtype)
    return dx, dw, None, None, (dy if has_residual else None)


matmul_in_place.defvjp(_in_place_fwd, _in_place_bwd)


def _fused_kernel(layer_ref, x_ref, *refs, tiles, block_k, k_steps, interpret):
    """Program column j computes output tile j of the concatenated outputs: weight i's tile
    j - (tiles before i), with `_product` unchanged, so every column has `_kernel`'s bits."""
    w_refs, o_refs = refs[: len(tiles)], refs[len(tiles) :]
    layer, j, start = layer_ref[0], pl.program_id(1), 0
    for w_ref, o_ref, count in zip(w_refs, o_refs, tiles):

        @pl.when((j >= start) & (j < start + count))
        def _(w_ref=w_ref, o_ref=o_ref):
            w_tile = lambda ks: w_ref[layer, :, ks]  # noqa: E731
            o_ref[...] = _product(x_ref, w_tile, o_ref.shape, block_k, k_steps, interpret).astype(o_ref.dtype)

        start += count


def matmul_layer_fused(x, ws, layer, config: MatmulConfig, interpret: bool):
    """[x @ w[layer].T for w in ws] in ONE launch (q/k/v, gate/up: one pass over x, and narrow
    outputs such as k/v share the GPU with the wide ones). Same tiles, same K order, same bits as
    separate `matmul_layer` calls (each output column is computed by the same code). Forward only.
    Shapes that are not tile multiples take separate calls."""
    c = config
    if x.ndim != 2 or any(w.ndim != 3 or w.shape[2] != x.shape[1] or w.shape[0] != ws[0].shape[0] for w in ws):
        raise ValueError(f"matmul_layer_fused shapes do not match: x {x.shape}, ws {[w.shape for w in ws]}")
    if any(w.shape[1] % c.block_n for w in ws) or x.shape[1] % c.block_k:
        return tuple(matmul_layer(x, w, layer, None, c, interpret) for w in ws)
    m, k = x.shape
    x = pad_dim(x, 0, c.block_m)
    mp = x.shape[0]
    tiles = tuple(w.shape[1] // c.block_n for w in ws)
    starts = np.cumsum((0,) + tiles[:-1])

    def w_spec(start, count):
        return pl.BlockSpec((ws[0].shape[0], c.block_n, k), lambda i, j: (0, jnp.clip(j - start, 0, count - 1), 0))

    def o_spec(start, count):
        return pl.BlockSpec((c.block_m, c.block_n), lambda i, j: (i, jnp.clip(j - start, 0, count - 1)))

    ys = pl.pallas_call(
        functools.partial(_fused_kernel, tiles=tiles, block_k=c.block_k, k_steps=k // c.block_k, interpret=interpret),
        name="matmul_fused_n" + "_".join(str(w.shape[1]) for w in ws) + f"_k{k}",
        grid=(mp // c.block_m, sum(tiles)),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (0,)),
            pl.BlockSpec((c.block_m, k), lambda i, j: (i, 0)),
            *(w_spec(int(s), n) for s, n in zip(starts, tiles)),
        ],
        out_specs=[o_spec(int(s), n) for s, n in zip(starts, tiles)],
        out_shape=[jax.ShapeDtypeStruct((mp, w.shape[1]), x.dtype) for w in ws],
        compiler_params=compiler_params(c.num_warps, c.num_stages),
        interpret=interpret,
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), x, *ws)
    return tuple(y[:m] for y in ys)


def matmul_reference(x, w, residual=None, config=None, interpret=None):
    """Plain XLA with the same roundings: what `numerics="fast"` runs."""
    acc = acc_dtype(x.dtype)
    y = jnp.dot(x, w.T, preferred_element_type=acc).astype(x.dtype)
    if residual is not None:
        y = (y.astype(acc) + residual.astype(acc)).astype(x.dtype)
    return y
