"""Rewards of sampled completions, never stopping the run for a reward that fails: a reward that raises, or a
math-verify check that runs past --reward-timeout, gets reward 0 and is counted (the row's `reward_failures`, of
which `reward_timeouts` ran out of time) and logged as a warning naming the example (its file and line) and
what went wrong. A reward that returns NaN or infinity still stops the run (train/guards.py check_rewards):
that is a bug in the reward, not a slow or odd completion.
"""

import logging

import numpy as np

from rlkjax.rl.rewards import RewardResult, checked_reward

log = logging.getLogger("train.grpo")


def reward_results(task, examples: list, completions: list) -> list[RewardResult]:
    """One RewardResult per (example, completion): a batch checked in parallel where the task can
    (math-verify's worker pool), else one by one."""
    check_many = getattr(task, "check_many", None)
    if check_many is not None:
        return check_many(examples, completions)
    return [checked_reward(task, e, c) for e, c in zip(examples, completions, strict=True)]


def group_rewards(where: str, task, examples: list, completions: list[list]) -> tuple[np.ndarray, dict]:
    """completions [P][G] of `examples` [P] (texts, or token ids for a task that `reads_token_ids`) -> (rewards
    [P, G] float64, the row's failure counts).
    `where` names the step (or evaluation) in the warnings."""
    flat_examples = [e for e, g in zip(examples, completions, strict=True) for _ in g]
    results = reward_results(task, flat_examples, [c for g in completions for c in g])
    group = len(completions[0]) if completions else 1
    for index, result in enumerate(results):
        if result.failure is not None:
            example = flat_examples[index]
            log.warning(
                "%s: the reward of prompt %d, sample %d (%s) failed (%s: %s); it counts as 0",
                where,
                index // group,
                index % group,
                example.source or repr(example.prompt[:80]),
                result.failure,
                result.detail,
            )
    rewards = np.array([r.reward for r in results], np.float64).reshape(len(completions), group)
    counts = {
        "reward_failures": sum(r.failure is not None for r in results),
        "reward_timeouts": sum(r.failure == "timeout" for r in results),
    }
    return rewards, counts


def episode_rewards(where: str, episodes: list) -> tuple[np.ndarray, dict]:
    """episodes [P][G] (train/episodes.py, finished) -> (rewards [P, G] float64: each episode's sum of its steps'
    rewards, the row's failure counts), warning about each failed reward as group_rewards does."""
    for index, episode in enumerate(e for g in episodes for e in g):
        for result in episode.failures:
            log.warning(
                "%s: a reward of episode %d (%s) failed (%s: %s); it counts as 0",
                where,
                index,
                episode.example.source or repr(episode.example.prompt[:80]),
                result.failure,
                result.detail,
            )
    rewards = np.array([[e.reward for e in g] for g in episodes], np.float64)
    failures = [r for g in episodes for e in g for r in e.failures]
    return rewards, {
        "reward_failures": len(failures),
        "reward_timeouts": sum(r.failure == "timeout" for r in failures),
    }
