"""Small helpers shared by the kernel wrappers: platform mode, padding, config checks."""

import jax
import jax.experimental.pallas.fuser  # noqa: F401  (see below)
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as plgpu

# The import above registers a config option (pallas_fuser_disable_nested_fuse) that is part of
# JAX's trace context. Pallas imports it lazily, at the first kernel call: every jitted function
# traced before that moment would be traced and compiled again on its next call (an engine that
# compiled its step functions at start would compile the first of them a second time mid-serving).

F32 = jnp.float32


def acc_dtype(dtype):
    """fp32 for bf16/fp32 inputs; float64 when a test evaluates a reference in float64 for truth."""
    return jnp.promote_types(dtype, F32)


def interpret_mode() -> bool:
    """Pallas runs compiled through Triton on GPUs and interpreted on the CPU; nothing else."""
    backend = jax.default_backend()
    if backend == "cpu":
        return True
    if backend in ("gpu", "cuda", "rocm"):
        return False
    raise RuntimeError(f"strict numerics need a GPU (Triton) or the CPU (interpret mode); got backend {backend!r}")


def compiler_params(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def check_block(name: str, value: int, minimum: int = 16) -> None:
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= {minimum} (Triton tiles)")


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pad_dim(x, axis: int, multiple: int, value=0):
    """Pad `axis` up to a multiple. lax.pad with a value of x's own dtype, so the lowered graph
    holds no dtype conversion: padding stays pure data movement."""
    extra = round_up(x.shape[axis], multiple) - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0, 0)] * x.ndim
    widths[axis] = (0, extra, 0)
    return jax.lax.pad(x, np.array(value, x.dtype), widths)


def dot_nt(a, b):
    """a [M, K] @ b [N, K].T with an fp32 accumulator; fp32 inputs get full fp32 products
    (Triton would otherwise use TF32)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == F32 else None
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=F32)


def dot_nn(a, b):
    """a [M, K] @ b [K, N] with an fp32 accumulator."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == F32 else None
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=F32)


def greedy_and_temperature(temp):
    """Rows with temperature 0 are greedy: they divide by 1 (the temperature-1 distribution) and
    draw without noise."""
    greedy = temp == 0.0
    return greedy, jnp.where(greedy, 1.0, temp)
