"""Sampler-vs-learner mismatch statistics for the same sampled tokens."""

import numpy as np


def mismatch_stats(sampled: np.ndarray, learner: np.ndarray) -> dict:
    """Tokens whose float32 logprob bits differ, max and mean |delta|, and the k3 estimate of
    KL(sampler || learner): mean of r - 1 - log r with r = p_learner / p_sampler."""
    sampled, learner = np.asarray(sampled, np.float32), np.asarray(learner, np.float32)
    delta = learner.astype(np.float64) - sampled.astype(np.float64)
    empty = delta.size == 0
    return {
        "tokens_compared": int(sampled.size),
        "tokens_bits_differ": int((sampled.view(np.uint32) != learner.view(np.uint32)).sum()),
        "max_abs_delta": 0.0 if empty else float(np.abs(delta).max()),
        "mean_abs_delta": 0.0 if empty else float(np.abs(delta).mean()),
        "k3_kl": 0.0 if empty else float(np.mean(np.expm1(delta) - delta)),
    }
