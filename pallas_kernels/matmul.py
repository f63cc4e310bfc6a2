"""Matmul with a fixed ascending K order into one fp32 accumulator: the model's projections and the
products behind every hand-written gradient.

`product(a, b, ...)` is the one Pallas call: a layout says which axes of a and b hold K ("nt": the
forward x [M, K] @ w [N, K].T, HF Linear's [out, in]; "nn": dx = dy @ w; "tn": dw = dy.T @ x), and b
may be every layer's weights stacked, [L, N, K] ("nt") or [L, K, N] ("nn"), with an int32 layer
index that the kernel reads inside the stack: a Pallas call takes each operand as a buffer of its
own, so slicing a layer out first would copy its weights before every call (the decode step's
dominant traffic). Each output tile walks K in `block_k` steps in ascending order, so a row's bits
do not depend on M, on the row's place in its tile, or on what else is in the batch. An optional
residual (Qwen3's `x + o_proj(...)`, `x + down_proj(...)`) is added in the epilogue, after the
product is rounded to the output dtype, as in the HF model.

`matmul` is the differentiable projection (its backward runs `product` too), `fused_product` several
projections of one input in one launch (the sampler's q/k/v and gate/up), `accumulate` the K loop of
one tile for kernels that add their own epilogue (logprob's backward).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.common import F32, acc_dtype, check_block, compiler_params, pad_dim


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 3
    # The backward's dx = dy @ w and dw = dy.T @ x: True reads w, dy and x where they lie ("nn",
    # "tn"); False multiplies transposed copies of them ("nt"), as the forward does. Either way a
    # fixed K order; the gradients' bits may differ between the two (NumericsOptions.matmul_backward).
    backward_in_place: bool = False

    def __post_init__(self):
        check_block("block_m", self.block_m)
        check_block("block_n", self.block_n)
        check_block("block_k", self.block_k)
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")


# layout -> (K's axis in a, K's axis in b): "nt" a [M, K], b [N, K]; "nn" a [M, K], b [K, N]; "tn" a [K, M], b [K, N]
K_AXES = {"nt": (1, 1), "nn": (1, 0), "tn": (0, 0)}


def _dot(a, b, dims):
    precision = jax.lax.Precision.HIGHEST if a.dtype == F32 else None  # fp32 inputs: full products, no TF32
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def accumulate(a_tile, b_tile, shape, block_k: int, k_steps: int, interpret: bool, layout: str = "nt"):
    """The fp32 accumulator [bm, bn] of one output tile: a_tile(ks) times b_tile(ks) (the operands'
    K slice `ks`, laid out as `layout` says) added for the K steps in ascending order."""
    a_k, b_k = K_AXES[layout]
    dims = (((a_k,), (b_k,)), ((), ()))

    def body(i, acc):
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        a, b = a_tile(ks), b_tile(ks)
        if not interpret:  # one dot per K step: Triton accumulates its K steps in order
            return acc + _dot(a, b, dims)
        # XLA:CPU runs a 128-wide bf16 x bf16 -> fp32 dot through a runtime call that does not support
        # it (under the 8-device shard_map of tests/test_sharding.py); 32-wide sub-steps, added in
        # order, stay on its inline emitter and keep a row's bits independent of the M/N tiles (an
        # fp32 upcast would not: XLA:CPU's fp32 GEMM blocks by shape).
        step = min(32, block_k)
        for j in range(0, block_k, step):
            a_j, b_j = (jax.lax.slice_in_dim(t, j, j + step, axis=ax) for t, ax in ((a, a_k), (b, b_k)))
            acc = acc + _dot(a_j, b_j, dims)
        return acc

    return jax.lax.fori_loop(0, k_steps, body, jnp.zeros(shape, F32))


# The K step of an adapter's product in the epilogue (its K is the rank, padded to a multiple of it): Triton's
# smallest dot, and a rank of 16 (PEFT's usual 8 padded, or 16) is one step.
ADAPTER_BLOCK_K = 16


def _kernel(*refs, layout, block_k, k_steps, stacked, has_residual, interpret, scale=None, adapter_k=0):
    if stacked:
        layer_ref, a_ref, b_ref, *refs = refs
    else:
        a_ref, b_ref, *refs = refs
    o_ref = refs[-1]
    a_k, b_k = K_AXES[layout]
    a_tile = (lambda ks: a_ref[:, ks]) if a_k else (lambda ks: a_ref[ks, :])
    if not stacked:
        b_tile = (lambda ks: b_ref[:, ks]) if b_k else (lambda ks: b_ref[ks, :])
    elif b_k:
        layer = layer_ref[0]
        b_tile = lambda ks: b_ref[layer, :, ks]  # noqa: E731
    else:  # the index loaded in each K step (the same bits as loading it once; a different program)
        b_tile = lambda ks: b_ref[layer_ref[0], ks, :]  # noqa: E731
    acc = accumulate(a_tile, b_tile, o_ref.shape, block_k, k_steps, interpret, layout)
    if scale is not None:  # a multiply and its rounding only: nothing for a compiler to fuse into an FMA
        acc = acc * jnp.float32(scale)
    y = acc.astype(o_ref.dtype)
    if adapter_k:  # y + u @ lora_b.T: the fp32 sum of the rounded product and the adapter's accumulator, rounded
        u_ref, lb_ref = refs[int(has_residual) : int(has_residual) + 2]
        u_tile, lb_tile = (lambda ks: u_ref[:, ks]), (lambda ks: lb_ref[:, ks])
        z = accumulate(u_tile, lb_tile, o_ref.shape, ADAPTER_BLOCK_K, adapter_k // ADAPTER_BLOCK_K, interpret)
        y = (y.astype(F32) + z).astype(o_ref.dtype)
    if has_residual:
        y = (y.astype(F32) + refs[0][...].astype(F32)).astype(o_ref.dtype)
    o_ref[...] = y


def _fits(b, layout: str, config: MatmulConfig) -> bool:
    """Whether the kernel can read a stacked b [L, N, K] ("nt") or [L, K, N] in place: its N and K
    whole tiles (the stack is not padded)."""
    n_axis, k_axis = (1, 2) if K_AXES[layout][1] else (2, 1)
    return not (b.shape[n_axis] % config.block_n or b.shape[k_axis] % config.block_k)


def product(
    a,
    b,
    config: MatmulConfig,
    interpret: bool,
    layout="nt",
    layer=None,
    residual=None,
    out_dtype=None,
    *,
    scale: float | None = None,
    adapter=None,
):
    """a @ b as `layout` says ("nt": a [M, K] @ b [N, K].T; "nn": a [M, K] @ b [K, N]; "tn":
    a [K, M].T @ b [K, N]) (+ residual [M, N]) -> [M, N] in out_dtype (default a.dtype; float32
    keeps the accumulator unrounded). Not differentiable (`matmul` is). With `layer`, b is a stack
    [L, N, K] or [L, K, N] read at that layer in place; a stack whose N or K is not a whole number
    of tiles is sliced (and padded) instead: the same bits, a copy. Odd shapes are padded with zeros
    (exact zero products) and the result sliced.

    LoRA's two extras (pallas_kernels/lora.py): `scale` multiplies the fp32 accumulator before it is
    rounded; `adapter` = (u [M, r], lora_b [N, r]) ("nt" only) adds u @ lora_b.T, accumulated in fp32
    over r in ascending steps of ADAPTER_BLOCK_K, to the rounded product before the residual:
    round(round(a @ b.T) + u @ lora_b.T), then + residual as without it."""
    c, (a_k, b_k) = config, K_AXES[layout]
    if a.ndim != 2 or b.ndim != (2 if layer is None else 3) or a.shape[a_k] != b.shape[b_k - 2]:
        raise ValueError(f"matmul shapes do not match ({layout}): {a.shape}, {b.shape}")
    if adapter is not None and (layout != "nt" or adapter[0].shape[1] != adapter[1].shape[1]):
        raise ValueError(f"an adapter needs layout 'nt' and u [M, r], lora_b [N, r]; got {layout}, {adapter}")
    if layer is not None and not _fits(b, layout, c):
        b, layer = jax.lax.dynamic_index_in_dim(b, layer, keepdims=False), None
    m, n = a.shape[1 - a_k], b.shape[-1 - b_k]
    a = pad_dim(pad_dim(a, 1 - a_k, c.block_m), a_k, c.block_k)
    mp, kp = a.shape[1 - a_k], a.shape[a_k]
    a_block = (c.block_m, kp) if a_k else (kp, c.block_m)
    in_specs = [pl.BlockSpec(a_block, (lambda i, j: (i, 0)) if a_k else (lambda i, j: (0, i)))]
    b_block = (c.block_n, kp) if b_k else (kp, c.block_n)
    b_index = (lambda i, j: (j, 0)) if b_k else (lambda i, j: (0, j))
    if layer is None:
        b = pad_dim(pad_dim(b, 0, c.block_n if b_k else c.block_k), 1, c.block_k if b_k else c.block_n)
        args = [a, b]
        in_specs.append(pl.BlockSpec(b_block, b_index))
    else:
        args = [jnp.reshape(layer, (1,)).astype(jnp.int32), a, b]
        in_specs = [pl.BlockSpec((1,), lambda i, j: (0,)), *in_specs]
        in_specs.append(pl.BlockSpec((b.shape[0], *b_block), lambda i, j: (0, *b_index(i, j))))
    np_ = b.shape[-1 - b_k]
    if residual is not None:
        args.append(pad_dim(pad_dim(residual, 0, c.block_m), 1, c.block_n))
        in_specs.append(pl.BlockSpec((c.block_m, c.block_n), lambda i, j: (i, j)))
    adapter_k = 0
    if adapter is not None:
        u, lora_b = (pad_dim(t, 1, ADAPTER_BLOCK_K) for t in adapter)  # zero columns: exact zero products
        adapter_k = u.shape[1]
        args += [pad_dim(u, 0, c.block_m), pad_dim(lora_b, 0, c.block_n)]
        in_specs.append(pl.BlockSpec((c.block_m, adapter_k), lambda i, j: (i, 0)))
        in_specs.append(pl.BlockSpec((c.block_n, adapter_k), lambda i, j: (j, 0)))
    extras = {"scale": scale} if scale is not None else {}
    if adapter_k:
        extras["adapter_k"] = adapter_k
    y = pl.pallas_call(
        functools.partial(
            _kernel,
            layout=layout,
            block_k=c.block_k,
            k_steps=kp // c.block_k,
            stacked=layer is not None,
            has_residual=residual is not None,
            interpret=interpret,
            **extras,  # absent without LoRA: the programs are the same text as before it existed
        ),
        name=(f"matmul_n{n}_k{kp}" if layout == "nt" else f"matmul_{layout}_n{n}_k{kp}")  # profiles tell them apart
        + ("_lora" if adapter_k else "")
        + ("_scaled" if scale is not None else ""),
        grid=(mp // c.block_m, np_ // c.block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((c.block_m, c.block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype or a.dtype),
        compiler_params=compiler_params(c.num_warps, c.num_stages),
        interpret=interpret,
    )(*args)
    return y[:m, :n]


def _fits_both_ways(stack, config: MatmulConfig) -> bool:
    """Whether the forward (x @ w.T) and dx = dy @ w can both read layers of stack [L, N, K] in place."""
    return _fits(stack, "nt", config) and _fits(stack, "nn", config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def matmul(x, w, residual, config: MatmulConfig, interpret: bool, stack=None, layer=None):
    """x [M, K] @ w [N, K].T (+ residual [M, N] or None) -> [M, N] in x.dtype, differentiable.

    With stack [L, N, K] and layer such that w = stack[layer]: the same bits and the same gradient
    bits, with the stack read in place by the forward and by dx = dy @ w. w is then never read: it
    carries the gradient dw (the caller's slice, which XLA drops from the forward); pass the stack
    through `jax.lax.stop_gradient` (its cotangent is not computed). A stack the kernels cannot read
    in place (N or K not whole tiles of either product) uses w."""
    if stack is not None and _fits_both_ways(stack, config):
        return product(x, stack, config, interpret, layer=layer, residual=residual)
    return product(x, w, config, interpret, residual=residual)


def _fwd(x, w, residual, config, interpret, stack, layer):
    out = matmul(x, w, residual, config, interpret, stack, layer)
    in_place = stack is not None and _fits_both_ways(stack, config)
    return out, (x, None if in_place else w, stack, layer, residual is not None)


def _bwd(config, interpret, saved, dy):
    """dx = dy @ w, dw = dy.T @ x, each in a fixed K order: deterministic run to run (no atomics, no split-K)."""
    x, w, stack, layer, has_residual = saved
    dr = dy if has_residual else None
    if not config.backward_in_place:
        w = stack[layer] if w is None else w
        dx = product(dy, w.T, config, interpret).astype(x.dtype)
        dw = product(dy.T.astype(x.dtype), x.T, config, interpret).astype(w.dtype)
    elif w is None:  # read from the stack in place
        dx = product(dy, stack, config, interpret, "nn", layer).astype(x.dtype)
        dw = product(dy.astype(x.dtype), x, config, interpret, "tn").astype(stack.dtype)
    else:
        dx = product(dy, w, config, interpret, "nn").astype(x.dtype)
        dw = product(dy.astype(x.dtype), x, config, interpret, "tn").astype(w.dtype)
    return dx, dw, dr, None, None


matmul.defvjp(_fwd, _bwd)


def _fused_kernel(layer_ref, x_ref, *refs, tiles, block_k, k_steps, interpret):
    """Program column j computes output tile j of the concatenated outputs: weight i's tile
    j - (tiles before i), with `accumulate` as `product` runs it, so every column has its bits."""
    w_refs, o_refs = refs[: len(tiles)], refs[len(tiles) :]
    layer, j, start = layer_ref[0], pl.program_id(1), 0
    for w_ref, o_ref, count in zip(w_refs, o_refs, tiles):

        @pl.when((j >= start) & (j < start + count))
        def _(w_ref=w_ref, o_ref=o_ref):
            x_tile, w_tile = (lambda ks: x_ref[:, ks]), (lambda ks: w_ref[layer, :, ks])
            o_ref[...] = accumulate(x_tile, w_tile, o_ref.shape, block_k, k_steps, interpret).astype(o_ref.dtype)

        start += count


def fused_product(x, stacks, layer, config: MatmulConfig, interpret: bool):
    """[x @ stack[layer].T for stack in stacks] in ONE launch (q/k/v, gate/up: one pass over x, and
    narrow outputs such as k/v share the GPU with the wide ones). Same tiles, same K order, same bits
    as separate `product` calls. Forward only. Shapes that are not tile multiples take separate calls."""
    c = config
    if x.ndim != 2 or any(w.ndim != 3 or w.shape[2] != x.shape[1] or w.shape[0] != stacks[0].shape[0] for w in stacks):
        raise ValueError(f"fused_product shapes do not match: x {x.shape}, stacks {[w.shape for w in stacks]}")
    if any(w.shape[1] % c.block_n for w in stacks) or x.shape[1] % c.block_k:
        return tuple(product(x, w, c, interpret, layer=layer) for w in stacks)
    m, k = x.shape
    x = pad_dim(x, 0, c.block_m)
    mp = x.shape[0]
    tiles = tuple(w.shape[1] // c.block_n for w in stacks)
    starts = np.cumsum((0,) + tiles[:-1])

    def w_spec(start, count):
        return pl.BlockSpec((stacks[0].shape[0], c.block_n, k), lambda i, j: (0, jnp.clip(j - start, 0, count - 1), 0))

    def o_spec(start, count):
        return pl.BlockSpec((c.block_m, c.block_n), lambda i, j: (i, jnp.clip(j - start, 0, count - 1)))

    ys = pl.pallas_call(
        functools.partial(_fused_kernel, tiles=tiles, block_k=c.block_k, k_steps=k // c.block_k, interpret=interpret),
        name="matmul_fused_n" + "_".join(str(w.shape[1]) for w in stacks) + f"_k{k}",
        grid=(mp // c.block_m, sum(tiles)),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (0,)),
            pl.BlockSpec((c.block_m, k), lambda i, j: (i, 0)),
            *(w_spec(int(s), n) for s, n in zip(starts, tiles)),
        ],
        out_specs=[o_spec(int(s), n) for s, n in zip(starts, tiles)],
        out_shape=[jax.ShapeDtypeStruct((mp, w.shape[1]), x.dtype) for w in stacks],
        compiler_params=compiler_params(c.num_warps, c.num_stages),
        interpret=interpret,
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), x, *stacks)
    return tuple(y[:m] for y in ys)


def matmul_reference(x, w, residual=None, config=None, interpret=None):
    """Plain XLA with the same roundings: what `numerics="fast"` runs."""
    acc = acc_dtype(x.dtype)
    y = jnp.dot(x, w.T, preferred_element_type=acc).astype(x.dtype)
    if residual is not None:
        y = (y.astype(acc) + residual.astype(acc)).astype(x.dtype)
    return y
