"""Evaluation during training: pass@k by hand, and a run with --eval-data that evaluates the held-out set
through its own rollout (row 0 the initial policy, then every --eval-every steps and after the last) while
training on the same bits as the run without it."""

import itertools
import json
import math

import jax
import numpy as np
import pytest

from tests.helpers import assert_bits_equal
from train import grpo
from train.evaluate import ks, pass_at_k

SMALL = dict(prompts_per_step=2, group_size=4, max_new_tokens=4, max_prompt_tokens=16, progress=False)


def test_pass_at_k_by_hand():
    # 4 samples, 1 correct: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2, pass@4 = 1
    assert [pass_at_k(4, 1, k) for k in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(8, 8, 1) == 1.0
    # The estimator is the probability that a random k-subset holds a correct sample.
    for n, c, k in [(6, 2, 3), (8, 3, 2), (5, 1, 5)]:
        subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
        assert math.isclose(pass_at_k(n, c, k), sum(any(s) for s in subsets) / len(subsets))
    assert ks(4) == [2, 4] and ks(6) == [2, 4, 6] and ks(2) == [2] and ks(8) == [2, 4, 8]


def write_problems(path, pairs):
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in pairs))
    return str(path)


@pytest.mark.slow  # two short training runs
def test_evaluation_in_training_leaves_training_unchanged(tmp_path):
    data = write_problems(tmp_path / "train.jsonl", [(1, 2), (3, 4), (5, 6)])
    held_out = write_problems(tmp_path / "eval.jsonl", [(2, 2), (7, 1), (4, 4)])  # 3: not a multiple of P
    base = dict(task="math", data=data, steps=3, checkpoint_every=0, **SMALL)
    with_eval = grpo.train(grpo.GRPOConfig(out=str(tmp_path / "e"), eval_data=held_out, eval_every=2, **base))
    without = grpo.train(grpo.GRPOConfig(out=str(tmp_path / "n"), **base))
    rows = with_eval["history"]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    evaluated = [r for r in rows if "eval_pass@1" in r]
    assert [r["step"] for r in evaluated] == [0, 2, 3]  # the initial policy, every 2 steps, after the last
    for r in evaluated:
        assert 0 <= r["eval_pass@1"] <= r["eval_pass@2"] <= r["eval_pass@4"] <= 1
        assert r["eval_pass@1_greedy"] in (0.0, 1 / 3, 2 / 3, 1.0) and r["eval_reward_failures"] == 0
    assert json.loads((tmp_path / "e" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 0
    assert (tmp_path / "e" / "plot.png").stat().st_size > 0
    # Evaluation samples with its own seeds: training's rows and weights are the same bits without it.
    for a, b in zip(rows[1:], without["history"], strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["loss"] == b["loss"]
    for a, b in zip(jax.tree.leaves(with_eval["master"]), jax.tree.leaves(without["master"]), strict=True):
        assert_bits_equal(np.asarray(a), np.asarray(b))
