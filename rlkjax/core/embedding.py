"""The token embedding: a gather whose gradient is summed in a fixed order, so a training step's weights
are the same bits on every run (rlkjax/core/model.py's forward calls it)."""

import jax
import jax.numpy as jnp


@jax.custom_vjp
def embed(table, ids):
    """table [V, D][ids [N]]: a gather (the same bits as plain indexing). Its gradient is summed by
    `_embed_bwd`, not by the scatter-add XLA would emit: on a GPU that runs as atomic adds in the
    table's dtype (bf16), so repeated tokens' gradients would be added in a different order each run."""
    return table[ids]


def _embed_fwd(table, ids):
    return table[ids], (ids, jnp.zeros((table.shape[0], 0), table.dtype))  # the ids, the table's shape and dtype


def _embed_bwd(saved, ct):
    """Each vocabulary row's gradient: its tokens' cotangents summed in fp32 in a fixed order (ids
    sorted stably, then a segmented scan: a fixed tree, no atomics), rounded once to the table's
    dtype and written with unique indices (a plain store on a GPU)."""
    ids, proto = saved
    vocab, n = proto.shape[0], ids.shape[0]
    order = jnp.argsort(ids, stable=True)
    sid = ids[order]
    new = sid[1:] != sid[:-1]
    first = jnp.concatenate([jnp.ones((1,), bool), new])  # a run of equal ids starts here
    last = jnp.concatenate([new, jnp.ones((1,), bool)])  # ... and ends here

    def add(a, b):  # segmented sum: b restarts the sum where a run starts
        return a[0] | b[0], jnp.where(b[0][:, None], b[1], a[1] + b[1])

    _, sums = jax.lax.associative_scan(add, (first, ct[order].astype(jnp.float32)))
    rows = jnp.where(last, sid, vocab + jnp.arange(n, dtype=sid.dtype))  # one row per run; the rest out of range
    grad = jnp.zeros((vocab, ct.shape[1]), proto.dtype)
    return grad.at[rows].set(sums.astype(proto.dtype), mode="drop", unique_indices=True), None


embed.defvjp(_embed_fwd, _embed_bwd)
