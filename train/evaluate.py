"""Evaluation during training: the held-out set of --eval-data, sampled through the run's own rollout (the
same engines or server, prompts rendered with the same chat template, completions ending at the same eos),
rewarded by the task; with --env, whole episodes through the environment, rewarded as in training. A completion
(or episode) is correct when its reward is at least 1 (math-verify's 1.0).

Per evaluation (the row's fields):
  eval_pass@1_greedy  the fraction of problems whose greedy completion (temperature 0) is correct;
  eval_pass@1         the mean, over problems, of the fraction of G samples (at --temperature) that are correct;
  eval_pass@k         for k = 2, 4, ... and G: the unbiased estimate 1 - C(G - c, k) / C(G, k) from c correct of
                      G samples (Chen et al., 2021), averaged over problems;
  eval_reward_mean    the sampled completions' mean reward; eval_reward_failures the checks that failed.

The sampling seeds come from (--seed, step), never from the training data's RNG, so evaluating does not change
what training samples: a run with evaluation trains on the same bits as one without.
"""

import dataclasses
import math

import numpy as np

from rlkjax.core.sampling_params import SamplingParams
from train.rewards import episode_rewards, group_rewards


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement from n (correct of them
    right) is right."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def ks(group_size: int) -> list[int]:
    """The k of the pass@k fields: powers of two below G, and G."""
    return sorted({2**i for i in range(1, group_size.bit_length()) if 2**i < group_size} | {group_size})


def sample_rewards(where: str, run, examples: list, seeds: list[int], sampling: SamplingParams) -> tuple:
    """[E][n] rewards of `examples` (and the failure counts), P at a time (the rollout's engines are sized for one
    step): single completions rewarded by the task, or with --env whole episodes rewarded as in training."""
    chunk = run.config.prompts_per_step
    if run.episodes is not None:
        episodes = []
        for start in range(0, len(examples), chunk):
            part = slice(start, start + chunk)
            episodes += run.episodes.run(run.rollout, examples[part], seeds[part], sampling, where)
        run.rollout.release_cache()
        return episode_rewards(where, episodes)
    texts = []
    for start in range(0, len(examples), chunk):
        part = slice(start, start + chunk)
        prompts = [run.tokenizer.encode(run.render(e.prompt)) for e in examples[part]]
        groups = run.rollout.sample(prompts, seeds[part], sampling)
        texts += [[run.tokenizer.decode(s["tokens"]) for s in g] for g in groups]
    return group_rewards(where, run.task, examples, texts)


def load_eval_set(config, make_task) -> list:
    """--eval-data's examples, read as the task reads --data (same format and fields), or [] without it."""
    if config.eval_data is None:
        return []
    return list(make_task(config.task, config.eval_data, None, config.prompt_field, config.answer_field).examples)


def due(step: int, config) -> bool:
    """Evaluate after this step (numbered from 1): every --eval-every steps and after the last."""
    return config.eval_data is not None and (step % config.eval_every == 0 or step == config.steps)


def evaluate(step: int, run, examples: list) -> dict:
    """The eval fields of the policy the rollout holds now (after `step` updates) on `examples`."""
    config, where = run.config, f"evaluation at step {step}"
    seeds = [int(s) for s in np.random.default_rng([config.seed, step]).integers(0, 2**32, len(examples))]
    greedy = dataclasses.replace(run.sampling, n=1, temperature=0.0)
    greedy_rewards, greedy_failures = sample_rewards(where, run, examples, seeds, greedy)
    rewards, failures = sample_rewards(where, run, examples, seeds, run.sampling)
    correct = (rewards >= 1.0).sum(axis=1)
    group = rewards.shape[1]
    row = {
        "eval_pass@1_greedy": float((greedy_rewards[:, 0] >= 1.0).mean()),
        "eval_pass@1": float((correct / group).mean()),
    }
    row |= {f"eval_pass@{k}": float(np.mean([pass_at_k(group, int(c), k) for c in correct])) for k in ks(group)}
    row |= {
        "eval_reward_mean": float(rewards.mean()),
        "eval_reward_failures": greedy_failures["reward_failures"] + failures["reward_failures"],
    }
    return row
