"""Shape helpers shared by the sampler and the learner: one of each, so both sides bucket, pad and
lay out pages the same way."""

import numpy as np


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


def bucket(n: int, minimum: int = 1) -> int:
    """The power of two >= max(n, minimum): shapes come in a few buckets, so a long run compiles a
    handful of functions."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def pad_sequences(sequences, rows: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> tokens, positions [rows, length] int32; padding has token 0 and position -1
    (the model writes it to the trash page and no real query sees it)."""
    tokens = np.zeros((rows, length), np.int32)
    positions = np.full((rows, length), -1, np.int32)
    for i, seq in enumerate(sequences):
        tokens[i, : len(seq)] = seq
        positions[i, : len(seq)] = np.arange(len(seq))
    return tokens, positions


def fresh_page_table(rows: int, pages_per_row: int):
    """Page table of a pass into fresh pages: row b owns pages 1 + b * pages_per_row, ... (page 0
    is the trash page). Works on traced shapes too (it returns a jax array)."""
    import jax.numpy as jnp

    return 1 + jnp.arange(rows * pages_per_row, dtype=jnp.int32).reshape(rows, pages_per_row)
