"""Sampler-vs-learner mismatch statistics for the same sampled tokens, overall and by position."""

import numpy as np

RATIO_BAND = (0.8, 1.2)  # PPO/GRPO's usual clip range: a ratio outside it is clipped off the gradient


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


def by_position(sampled: list[np.ndarray], learner: list[np.ndarray], edges: list[int]) -> list[dict]:
    """`mismatch_stats` per bucket of completion positions [edges[i], edges[i+1]) (position 0 is a completion's
    first sampled token), plus the share of tokens whose ratio p_learner / p_sampler leaves RATIO_BAND: where a
    mismatch that grows along a sequence would show. sampled[i], learner[i]: row i's logprobs, same length."""
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        s = [np.asarray(a, np.float32)[lo:hi] for a in sampled]
        t = [np.asarray(b, np.float32)[lo:hi] for b in learner]
        s, t = np.concatenate(s), np.concatenate(t)
        ratio = np.exp(t.astype(np.float64) - s.astype(np.float64))
        outside = float(np.mean((ratio < RATIO_BAND[0]) | (ratio > RATIO_BAND[1]))) if ratio.size else 0.0
        rows.append({"positions": [lo, hi]} | mismatch_stats(s, t) | {"ratio_outside_band": outside})
    return rows
