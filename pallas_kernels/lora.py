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

import jax
import jax.numpy as jnp

from pallas_kernels.common import acc_dtype
from pallas_kernels.matmul import MatmulConfig, _fits, product


def _base(w, stack, layer, layout: str, config: MatmulConfig):
    """(b, layer) for `product`: the stack read in place where it fits the layout's tiles, else the layer's w
    (or the stack sliced by `product` when w is None)."""
    if stack is not None and (w is None or _fits(stack, layout, config)):
        return stack, layer
    return w, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def adapted_matmul(x, w, residual, lora_a, lora_b, config: MatmulConfig, interpret: bool, scale: float, stack, layer):
    """x [M, K] @ w [N, K].T + scale * (x @ lora_a [r, K].T) @ lora_b [N, r].T (+ residual [M, N] or None)
    -> [M, N] in x.dtype; differentiable in x, residual, lora_a, lora_b (w is frozen: no gradient).
    stack [L, N, K] and layer (w = stack[layer]) let the kernels read the base weight in place (w may then be
    None, forward only); None: w is read."""
    u = product(x, lora_a, config, interpret, scale=scale)
    b, at = _base(w, stack, layer, "nt", config)
    return product(x, b, config, interpret, layer=at, residual=residual, adapter=(u, lora_b))


def _fwd(x, w, residual, lora_a, lora_b, config, interpret, scale, stack, layer):
    u = product(x, lora_a, config, interpret, scale=scale)
    b, at = _base(w, stack, layer, "nt", config)
    y = product(x, b, config, interpret, layer=at, residual=residual, adapter=(u, lora_b))
    in_place = stack is not None and _fits(stack, "nn", config)  # dx reads the stack: w is not kept (nor sliced)
    return y, (x, None if in_place else w, lora_a, lora_b, u, stack, layer, residual is not None)


def _bwd(config, interpret, scale, saved, dy):
    x, w, lora_a, lora_b, u, stack, layer, has_residual = saved
    dy = dy.astype(x.dtype)
    du = product(dy, lora_b, config, interpret, "nn", scale=scale)  # [M, r]
    d_lora_b = product(dy, u, config, interpret, "tn").astype(lora_b.dtype)  # [N, r]
    d_lora_a = product(du, x, config, interpret, "tn").astype(lora_a.dtype)  # [r, K]
    b, at = _base(w, stack, layer, "nn", config)
    dx = product(dy, b, config, interpret, "nn", at, residual=product(du, lora_a, config, interpret, "nn"))
    return dx, None, dy if has_residual else None, d_lora_a, d_lora_b, None, None


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
