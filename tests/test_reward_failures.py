"""The trainer's policy for rewards that fail: a reward that raises, or a math-verify check past its time,
gets reward 0, is counted in the row and logged with the example it failed on; the run goes on. Real math-verify
worker processes and a real Parquet file."""

import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlkjax.rl.data import Example
from rlkjax.rl.tasks import ArithmeticTask, make_task
from tests.helpers import SLOW_ANSWER
from train import grpo
from train.rewards import group_rewards


def failing_reward(prompt, completion):
    if "boom" in completion:
        raise RuntimeError("the reward broke")
    return 1.0


@pytest.fixture(scope="module")
def parquet(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "problems.parquet"
    pq.write_table(
        pa.table({"question": ["What is 1/2 + 1/4?", "What is 6*7?"], "solution": ["\\frac{3}{4}", "42"]}), path
    )
    return str(path)


def test_math_task_on_a_parquet_file(parquet, caplog):
    task = make_task("math", parquet, prompt_field="question", answer_field="solution")
    examples = task.examples
    texts = [["so \\boxed{0.75}", "it is 3/4", "\\boxed{1}"], ["6*7 = 42", "\\boxed{41}", "\\boxed{42}"]]
    with caplog.at_level(logging.WARNING):
        rewards, counts = group_rewards("step 1", task, examples, texts)
    np.testing.assert_array_equal(rewards, [[1, 1, 0], [1, 0, 1]])
    assert counts == {"reward_failures": 0, "reward_timeouts": 0} and not caplog.records


def test_a_check_past_its_time_scores_zero_and_is_counted(parquet, caplog):
    """Checks that cannot finish in time (SLOW_ANSWER): with a quick answer and a microsecond's timeout,
    a loaded machine that ran the worker before it ran the waiting trainer let the answer in."""
    task = make_task("math", parquet, prompt_field="question", answer_field="solution", reward_timeout=0.01)
    with caplog.at_level(logging.WARNING):
        rewards, counts = group_rewards("step 3", task, task.examples[:1], [[SLOW_ANSWER, SLOW_ANSWER]])
    np.testing.assert_array_equal(rewards, [[0, 0]])
    assert counts == {"reward_failures": 2, "reward_timeouts": 2}
    assert f"step 3: the reward of prompt 0, sample 1 ({parquet}:row 1) failed (timeout" in caplog.text


def test_a_reward_that_raises_scores_zero_and_is_counted(caplog):
    task = make_task("arithmetic", reward="tests.test_reward_failures:failing_reward")
    examples = [Example("1+1=", "2", "gen:7")]
    with caplog.at_level(logging.WARNING):
        rewards, counts = group_rewards("step 2", task, examples, [["2", "boom"]])
    np.testing.assert_array_equal(rewards, [[1, 0]])
    assert counts == {"reward_failures": 1, "reward_timeouts": 0}
    assert (
        "step 2: the reward of prompt 0, sample 1 (gen:7) failed (error: tests.test_reward_failures:failing_reward "
        "raised RuntimeError: the reward broke)" in caplog.text
    )
    assert group_rewards("step 2", ArithmeticTask(), examples, [["2", "3"]])[0].tolist() == [[1, 0]]


@pytest.mark.parametrize(
    "flags, match",
    [
        ({"task": "lowercase", "data": "x.jsonl"}, "read only by --task gsm8k and math"),
        ({"task": "math", "data": "x.jsonl", "reward_timeout": 0.0}, "--reward-timeout=0.0 must be a positive"),
        ({"task": "math", "data": "x.jsonl", "reward_timeout": float("nan")}, "--reward-timeout=nan"),
    ],
)
def test_bad_math_flags(flags, match):
    with pytest.raises(ValueError, match=match):
        grpo.GRPOConfig(**flags)
