"""--task synthetic-token-ids: a reward over the sampled token ids, given the ids and not their text."""

import numpy as np
import pytest

from rlkjax.rl.tasks import Example, TokenIdsTask, make_task
from train import grpo
from train.config import GRPOConfig


def test_reward_is_the_fraction_of_ids_that_are_multiples_of_64():
    task = make_task("synthetic-token-ids")
    assert isinstance(task, TokenIdsTask) and task.reads_token_ids
    assert task.reward(Example("AB:"), [0, 64, 65, 151_872]) == 0.75
    assert task.reward(Example("AB:"), [1, 2, 3]) == 0.0 and task.reward(Example("AB:"), []) == 0.0
    prompts = task.sample(np.random.default_rng(0), 3)
    assert len(prompts) == 3 and all(p.prompt.endswith(":") for p in prompts)


def test_a_grpo_step_rewards_the_sampled_ids(tmp_path, monkeypatch):
    """The step hands the reward each completion's token ids, and its row's reward is their mean."""
    seen = []
    real = TokenIdsTask.reward

    def recording(self, example, completion):
        seen.append((list(completion), real(self, example, completion)))
        return seen[-1][1]

    monkeypatch.setattr(TokenIdsTask, "reward", recording)
    config = GRPOConfig(
        task="synthetic-token-ids",
        steps=1,
        prompts_per_step=2,
        group_size=4,
        max_new_tokens=8,
        max_prompt_tokens=16,
        ignore_eos=True,
        checkpoint_every=0,
        progress=False,
        out=str(tmp_path),
    )
    (row,) = grpo.train(config)["history"]
    assert len(seen) == 8
    for ids, reward in seen:
        assert len(ids) == 8 and all(isinstance(t, int) for t in ids)
        assert reward == sum(t % 64 == 0 for t in ids) / 8
    assert row["reward_mean"] == np.mean([r for _, r in seen]) and row["tokens_bits_differ"] == 0


def test_multi_turn_episodes_are_refused():
    with pytest.raises(ValueError, match="synthetic-token-ids reads ids"):
        GRPOConfig(task="synthetic-token-ids", env="calculator")
