"""rlkjax.core.mismatch: the statistics every mismatch figure comes from, on inputs whose answers are worked out
by hand. Prevents: a bucket that drops or double-counts a row's tokens, a ratio band tested on the wrong side."""

import numpy as np

from rlkjax.core.mismatch import by_position, mismatch_stats


def test_mismatch_stats_counts_bits_and_k3():
    """delta = learner - sampler = (0, log 2): one token's bits differ; k3 = mean(e^d - 1 - d) = (0 + 1 - log 2)/2."""
    sampled = np.array([-1.0, -2.0], np.float32)
    learner = np.array([-1.0, -2.0 + np.log(2.0)], np.float32)
    stats = mismatch_stats(sampled, learner)
    assert stats["tokens_compared"] == 2 and stats["tokens_bits_differ"] == 1
    delta = float(learner[1]) - float(sampled[1])
    assert stats["max_abs_delta"] == delta and stats["mean_abs_delta"] == delta / 2
    assert stats["k3_kl"] == (np.expm1(delta) - delta) / 2


def test_by_position_partitions_tokens_and_reads_the_band():
    """Two rows of lengths 5 and 2; buckets [0, 2) and [2, 8). Row 0's position 3 has ratio e^0.5 = 1.65 (outside
    [0.8, 1.2]); row 1's position 1 has ratio e^-0.1 = 0.905 (inside). So bucket [0, 2) compares 4 tokens, 1 differs,
    none outside; bucket [2, 8) compares 3 tokens, 1 differs, 1 of 3 outside."""
    sampled = [np.full(5, -1.0, np.float32), np.full(2, -3.0, np.float32)]
    learner = [s.copy() for s in sampled]
    learner[0][3] += 0.5
    learner[1][1] -= 0.1
    first, second = by_position(sampled, learner, [0, 2, 8])
    assert first["positions"] == [0, 2] and second["positions"] == [2, 8]
    assert (first["tokens_compared"], first["tokens_bits_differ"], first["ratio_outside_band"]) == (4, 1, 0.0)
    assert (second["tokens_compared"], second["tokens_bits_differ"], second["ratio_outside_band"]) == (3, 1, 1 / 3)
