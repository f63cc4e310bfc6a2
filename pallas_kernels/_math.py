"""The math primitives every kernel uses, in one place.

The sampler and the learner run the same kernels, so they share these by construction; keeping
them here means a change to how exp or rsqrt is evaluated is one edit, seen by every kernel.
All of them take and return float32.
"""

import jax.numpy as jnp

F32 = jnp.float32


def exp(x):
    return jnp.exp(x)


def log(x):
    return jnp.log(x)


def rsqrt(x):
    # 1/sqrt written out: lax.rsqrt has no Triton lowering on every backend, division does.
    return 1.0 / jnp.sqrt(x)


def sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def silu(x):
    return x * sigmoid(x)


def hash_u32(x):
    """lowbias32 integer mixer (Wellons): a cheap, well-mixed uint32 -> uint32 bijection."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(row_key, cols):
    """Gumbel(0, 1) noise for vocabulary ids `cols` [R, C] given a per-row key [R, 1] (uint32).

    The noise for a token depends on (request seed, step, vocab id) only, never on the row's
    slot in a batch or the vocab tile size, so a request samples the same tokens however it was
    batched.
    """
    bits = hash_u32(row_key ^ hash_u32(cols.astype(jnp.uint32) + jnp.uint32(0x9E3779B9)))
    return -log(-log(uniform(bits)))


def uniform(bits):
    """A uniform in (0, 1) from a uint32's top 23 bits k, centred: (k + 0.5) / 2^23 = (2k + 1) / 2^24 is exact
    in float32 for every k, so u is never 0 or 1. (With 24 bits, k + 0.5 rounds to k + 1 at the top, and
    k = 2^24 - 1 gives u = 1 and Gumbel noise +inf: over Qwen3's 151,936 ids, one sampled token in 110
    would be an arbitrary id.)"""
    return ((bits >> 9).astype(F32) + 0.5) * (1.0 / (1 << 23))


NO_TOKEN = 2**31 - 1  # above every vocabulary id: what a min over a tile's ids returns where none matches


def gumbel_max_tile(values, logits, cols, key, greedy):
    """One vocabulary tile's Gumbel-max pick, shared by the sampler kernels (logprob, truncation):
    score = values + gumbel_noise (greedy rows: values alone), the tile's best score [R], the id that
    has it [R] (ties: the lowest id, so with a strict > across tiles the whole vocabulary's lowest id
    wins), and that id's entry of `logits` [R]. values, logits [R, C]; cols [1, C]; key, greedy [R]."""
    score = jnp.where(greedy[:, None], values, values + gumbel_noise(key[:, None], cols))
    tile_best = jnp.max(score, axis=1)
    tile_tok = jnp.min(jnp.where(score == tile_best[:, None], cols, NO_TOKEN), axis=1)
    tile_logit = jnp.max(jnp.where(cols == tile_tok[:, None], logits, -jnp.inf), axis=1)
    return tile_best, tile_tok, tile_logit


def row_key(seeds, steps):
    """Per-row sampling key from (request seed, token index): [R] uint32."""
    return hash_u32(hash_u32(seeds.astype(jnp.uint32)) ^ (steps.astype(jnp.uint32) * jnp.uint32(0x85EBCA6B)))
