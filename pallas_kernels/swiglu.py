"""SwiGLU: silu(gate) * up, elementwise, with the HF model's rounding points.

gate, up [N, F] -> [N, F]: silu in fp32 rounded to the input dtype, then the product in fp32
rounded again (HF computes `act_fn(gate_proj(x)) * up_proj(x)` as two rounded tensor ops).
"""

import dataclasses
import functools

import jax
from jax.experimental import pallas as pl

from pallas_kernels import _math
from pallas_kernels.common import acc_dtype, check_block, compiler_params, pad_dim


@dataclasses.dataclass(frozen=True)
class SwiGLUConfig:
    block_rows: int = 16
    block_cols: int = 128
    num_warps: int = 4

    def __post_init__(self):
        check_block("block_rows", self.block_rows)
        check_block("block_cols", self.block_cols)


def _swiglu(g, u, dtype):
    acc = acc_dtype(dtype)
    s = _math.silu(g.astype(acc)).astype(dtype)
    return (s.astype(acc) * u.astype(acc)).astype(dtype)


def _kernel(g_ref, u_ref, o_ref):
    o_ref[...] = _swiglu(g_ref[...], u_ref[...], o_ref.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def swiglu(gate, up, config: SwiGLUConfig, interpret: bool):
    if gate.shape != up.shape or gate.ndim != 2:
        raise ValueError(f"swiglu shapes do not match: gate {gate.shape}, up {up.shape}")
    n, f = gate.shape
    # Column tiles are powers of two (Triton); an odd F is padded up to whole tiles and sliced back.
    br, bc = config.block_rows, min(config.block_cols, pl.next_power_of_2(f))
    g, u = (pad_dim(pad_dim(a, 0, br), 1, bc) for a in (gate, up))
    spec = pl.BlockSpec((br, bc), lambda i, j: (i, j))
    y = pl.pallas_call(
        _kernel,
        name="swiglu",
        grid=(g.shape[0] // br, g.shape[1] // bc),
        in_specs=[spec, spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(g.shape, gate.dtype),
        compiler_params=compiler_params(config.num_warps, 1),
        interpret=interpret,
    )(g, u)
    return y[:n, :f]


def _fwd(gate, up, config, interpret):
    return swiglu(gate, up, config, interpret), (gate, up)


def _bwd(config, interpret, saved, dy):
    _, vjp = jax.vjp(swiglu_reference, *saved)
    return vjp(dy)


swiglu.defvjp(_fwd, _bwd)


def swiglu_reference(gate, up, config=None, interpret=None):
    return _swiglu(gate, up, gate.dtype)
