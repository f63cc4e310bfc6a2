"""Matmul y = x @ w.T (+ residual): fixed ascending K order into one fp32 accumulator.

x [M, K], w [N, K] (HF Linear layout, [out, in]), optional residual [M, N]; y [M, N] in x.dtype.
Each output tile walks K in `block_k` steps in ascending order, so a row's bits do not depend on
M, on the row's place in its tile, or on what else is in the batch. The residual add (Qwen3's
`x + o_proj(...)`, `x + down_proj(...)`) happens in the epilogue, after the product is rounded
to the output dtype, as in the HF model.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import F32, acc_dtype, check_block, compiler_params, dot_nt, pad_dim


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_block("block_m", self.block_m)
        check_block("block_n", self.block_n)
        check_block("block_k", self.block_k)
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")


def _kernel(x_ref, w_ref, *refs, block_k, k_steps, has_residual):
    o_ref = refs[-1]

    def body(i, acc):
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        return acc + dot_nt(x_ref[:, ks], w_ref[:, ks])

    acc = jax.lax.fori_loop(0, k_steps, body, jnp.zeros(o_ref.shape, F32))
    y = acc.astype(o_ref.dtype)
    if has_residual:
        y = (y.astype(F32) + refs[0][...].astype(F32)).astype(o_ref.dtype)
    o_ref[...] = y


def _pallas_matmul(x, w, residual, config: MatmulConfig, interpret: bool):
    m, n = x.shape[0], w.shape[0]
    c = config
    x = pad_dim(pad_dim(x, 0, c.block_m), 1, c.block_k)
    w = pad_dim(pad_dim(w, 0, c.block_n), 1, c.block_k)
    mp, kp = x.shape
    np_ = w.shape[0]
    args = [x, w]
    in_specs = [
        pl.BlockSpec((c.block_m, kp), lambda i, j: (i, 0)),
        pl.BlockSpec((c.block_n, kp), lambda i, j: (j, 0)),
    ]
    if residual is not None:
        args.append(pad_dim(pad_dim(residual, 0, c.block_m), 1, c.block_n))
        in_specs.append(pl.BlockSpec((c.block_m, c.block_n), lambda i, j: (i, j)))
    y = pl.pallas_call(
        functools.partial(_kernel, block_k=c.block_k, k_steps=kp // c.block_k, has_residual=residual is not None),
        grid=(mp // c.block_m, np_ // c.block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((c.block_m, c.block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
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
    # Same kernel, same fixed K order: deterministic run to run (no atomics, no split-K).
    x, w, has_residual = saved
    dx = _pallas_matmul(dy, w.T, None, config, interpret).astype(x.dtype)
    dw = _pallas_matmul(dy.T.astype(x.dtype), x.T, None, config, interpret).astype(w.dtype)
    return dx, dw, (dy if has_residual else None)


matmul.defvjp(_fwd, _bwd)


def matmul_reference(x, w, residual=None, config=None, interpret=None):
    """Plain XLA with the same roundings: what `numerics="fast"` runs."""
    acc = acc_dtype(x.dtype)
    y = jnp.dot(x, w.T, preferred_element_type=acc).astype(x.dtype)
    if residual is not None:
        y = (y.astype(acc) + residual.astype(acc)).astype(x.dtype)
    return y
