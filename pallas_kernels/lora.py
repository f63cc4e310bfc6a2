"""A LoRA-adapted projection: y = x @ w.T + scale * (x @ lora_a.T) @ lora_b.T (+ residual), w frozen, in two
calls of pallas_kernels/matmul.py's `product` (the same K loop as every other matmul):

  u = round(scale * (x @ lora_a.T))                       [M, r]  the scale in the down projection's epilogue
  y = round(round(x @ w.T) + u @ lora_b.T) (+ residual)   [M, N]  the adapter in the base product's epilogue

PEFT computes round(round(x @ w.T) + scale * (lora_b(lora_a(x)))); the scale's place differs (on u here: one
rounded multiply inside a kernel, nothing an XLA fusion or an FMA contraction can rewrite), the rounding points
of the base product are the same. Any scale works (alpha / r need not be a power of two): it is applied in a
kernel, never folded into a weight. No XLA arithmetic on the logprob path, and every sum in a fixed order.

The backward computes no gradient for w (frozen: what makes LoRA cheap) and, with s = scale:
  du = s * dy @ lora_b     dlora_b = dy.T @ u     dlora_a = du.T @ x     dx = dy @ w + du @ lora_a
each a `product` in a fixed K order (dx's sum in the residual epilogue), so the gradients are the same bits run
to run.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.common import acc_dtype
from pallas_kernels.matmul import MatmulConfig, _fits, product


class Adapted(NamedTuple):
    """What an adapted matmul holds fixed (a custom_vjp's static argument): the tiles, the lowering, the scale."""

    config: MatmulConfig
    interpret: bool
    scale: float


def _base(base, layout: str, config: MatmulConfig):
    """(b, layer) for `product` from base = (w, stack, layer): the stack read in place where it fits the layout's
    tiles, else the layer's w (or the stack sliced by `product` when w is None)."""
    w, stack, layer = base
    if stack is not None and (w is None or _fits(stack, layout, config)):
        return stack, layer
    return w, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def adapted_matmul(x, base, residual, adapter, setting: Adapted):
    """x [M, K] @ w [N, K].T + scale * (x @ lora_a [r, K].T) @ lora_b [N, r].T (+ residual [M, N] or None)
    -> [M, N] in x.dtype, differentiable in x, residual and adapter = (lora_a, lora_b); base = (w, stack,
    layer) is frozen (no gradient): w the layer's weight, or stack [L, N, K] and layer (w = stack[layer]) for the
    kernels to read it in place (w may then be None, forward only; stack None: w is read)."""
    return _fwd(x, base, residual, adapter, setting)[0]


def _fwd(x, base, residual, adapter, setting: Adapted):
    (lora_a, lora_b), c = adapter, setting.config
    u = product(x, lora_a, c, setting.interpret, scale=setting.scale)
    b, at = _base(base, "nt", c)
    y = product(x, b, c, setting.interpret, layer=at, residual=residual, adapter=(u, lora_b))
    w, stack, layer = base
    in_place = stack is not None and _fits(stack, "nn", c)  # dx reads the stack: w is not kept (nor sliced)
    return y, (x, (None if in_place else w, stack, layer), lora_a, lora_b, u, residual is not None)


def _bwd(setting: Adapted, saved, dy):
    x, base, lora_a, lora_b, u, has_residual = saved
    c, interpret = setting.config, setting.interpret
    dy = dy.astype(x.dtype)
    du = product(dy, lora_b, c, interpret, "nn", scale=setting.scale)  # [M, r]
    d_lora_b = product(dy, u, c, interpret, "tn").astype(lora_b.dtype)  # [N, r]
    d_lora_a = product(du, x, c, interpret, "tn").astype(lora_a.dtype)  # [r, K]
    b, at = _base(base, "nn", c)
    dx = product(dy, b, c, interpret, "nn", at, residual=product(du, lora_a, c, interpret, "nn"))
    return dx, None, dy if has_residual else None, (d_lora_a, d_lora_b)


adapted_matmul.defvjp(_fwd, _bwd)


def adapted_matmul_reference(x, w, residual, lora_a, lora_b, scale: float):
    """Plain XLA with the same rounding points: what `numerics="fast"` runs (and the tests' truth in float64)."""
    acc = acc_dtype(x.dtype)
    u = (jnp.dot(x, lora_a.T, preferred_element_type=acc) * scale).astype(x.dtype)
    y = jnp.dot(x, w.T, preferred_element_type=acc).astype(x.dtype)
    y = (y.astype(acc) + jnp.dot(u, lora_b.T, preferred_element_type=acc)).astype(x.dtype)
    if residual is not None:
        y = (y.astype(acc) + residual.astype(acc)).astype(x.dtype)
    return y
