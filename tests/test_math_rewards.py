"""Verifier rewards on local data: math-verify checks (LaTeX, \\boxed{}, fractions, plain numbers) each
bounded in time and usable from any thread, failures reported with a reason, and JSONL / Parquet / CSV
files read with named prompt and answer fields (a math task over a real Parquet file)."""

import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlkjax.rl.rewards import MathVerifier, RewardResult, checked_reward
from rlkjax.rl.tasks import Example, make_task
from tests.helpers import SLOW_ANSWER


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(timeout=10.0) as v:
        yield v


@pytest.mark.parametrize(
    "completion, answer, reward",
    [
        ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
        ("so \\boxed{1/2}", "0.5", 1.0),
        ("It is 0.75", "$\\frac{3}{4}$", 1.0),
        ("I think it is 42.", "42", 1.0),
        ("First 3, then 9, finally \\boxed{7}", "7", 1.0),
        ("$\\boxed{\\sqrt 2}$", "\\sqrt{2}", 1.0),  # a bare-LaTeX reference is read inside $...$
        ("\\boxed{1000}", "1,000", 1.0),
        ("\\boxed{41}", "42", 0.0),
        ("\\boxed{\\frac{2}{3}}", "\\frac{3}{2}", 0.0),
        ("no number at all", "3", 0.0),
        # full-width digits and signs, as a real Qwen3 writes at times: NFKC-normalised before the check
        ("The answer is ２０.", "20", 1.0),
        ("so \\boxed{２０}", "20", 1.0),
        ("\\boxed{－３}", "-3", 1.0),
        ("\\boxed{20}", "２０", 1.0),
        ("\\boxed{２１}", "20", 0.0),
    ],
)
def test_math_verify_rewards(verifier, completion, answer, reward):
    assert verifier(completion, answer) == RewardResult(reward)


@pytest.mark.slow  # the default run's timeout: test_a_batch_over_two_workers_keeps_order_and_bounds_each_check
def test_timeout_is_reported_and_the_next_check_works():
    """A check past its time gets reward 0 and failure "timeout" within about the timeout (the worker
    is killed, not waited for), and the verifier keeps working with a fresh worker."""
    with MathVerifier(timeout=1.0) as v:
        assert v("\\boxed{2}", "2") == RewardResult(1.0)  # the worker is started and warm
        start = time.monotonic()
        result = v(SLOW_ANSWER, "1")
        assert time.monotonic() - start < 1.0 + 2.0  # the bound plus a kill, on a loaded 2-core machine
        assert (result.reward, result.failure) == (0.0, "timeout") and "1 s" in result.detail
        assert v("\\boxed{\\frac{6}{4}}", "\\frac{3}{2}") == RewardResult(1.0)


def test_a_batch_over_two_workers_keeps_order_and_bounds_each_check():
    """check_many spreads a training step's completions over the workers: results come back in input
    order, a check past its time fails alone (its worker is replaced) and the others still score."""
    pairs = [("\\boxed{3}", "3"), (SLOW_ANSWER, "1"), ("\\boxed{\\frac{1}{3}}", "1/3"), ("4", "5"), ("so 8", "8")]
    with MathVerifier(timeout=2.0, workers=2) as v:
        results = v.check_many(pairs)
        assert [r.reward for r in results] == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert [r.failure for r in results] == [None, "timeout", None, None, None]
        assert v.check_many([]) == [] and v("\\boxed{9}", "9") == RewardResult(1.0)


def test_bounded_from_a_thread(verifier):
    """math-verify's own timeout is SIGALRM-based and refuses to run off the main thread (this is why the
    checks run in a worker process); the verifier works from a trainer's or server's thread."""
    from math_verify import parse, verify

    results, errors = [], []

    def run():
        results.append(verifier("\\boxed{5}", "5"))
        try:
            verify(parse("$1$"), parse("$1$"), timeout_seconds=1)
        except ValueError as e:
            errors.append(str(e))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert results == [RewardResult(1.0)]
    assert errors and "threaded environment" in errors[0]


def test_errors_are_reported_not_raised(verifier):
    result = verifier("\\boxed{1}", "")
    assert (result.reward, result.failure) == (0.0, "error") and "does not parse" in result.detail


ROWS = [
    {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "solution": "\\frac{3}{4}"},
    {"problem": "Compute 6 * 7.", "solution": "42"},
    {"problem": "Simplify 10/4.", "solution": "5/2"},
]


def failing_reward(prompt, completion):
    raise ZeroDivisionError("a user's reward that raises")


def test_checked_reward_reports_a_raising_user_reward(tmp_path):
    task = make_task("arithmetic", reward="tests.test_math_rewards:failing_reward")
    result = checked_reward(task, Example("1+1=", "2"), "2")
    assert (result.reward, result.failure) == (0.0, "error") and "ZeroDivisionError" in result.detail
    assert checked_reward(make_task("arithmetic"), Example("1+1=", "2"), " 2") == RewardResult(1.0)


def test_math_task_from_a_parquet_file(tmp_path):
    parquet = tmp_path / "problems.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    task = make_task("math", data=str(parquet), prompt_field="problem", answer_field="solution", reward_timeout=10)
    try:
        examples = task.sample(np.random.default_rng(0), 4)
        assert all(e in task.examples for e in examples)
        by_answer = {e.answer: e for e in task.examples}
        assert task.check(by_answer["\\frac{3}{4}"], "So the sum is $\\boxed{0.75}$") == RewardResult(1.0)
        assert task.reward(by_answer["5/2"], "10/4 = \\boxed{\\frac{5}{2}}") == 1.0
        assert task.reward(by_answer["42"], "\\boxed{43}") == 0.0
        batch = task.check_many([by_answer["42"], by_answer["5/2"]], ["\\boxed{42}", "2.5"])
        assert batch == [RewardResult(1.0), RewardResult(1.0)]
    finally:
        task.verifier.close()
