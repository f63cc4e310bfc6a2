"""Fair turns over HTTP: a small request sent while a big multi-sequence request fills the batch of
a real `python -m serve.rollout` finishes long before it (counted in engine steps, not seconds, so
a busy machine does not change what is checked), with the tokens and logprob bits it gets alone."""

import concurrent.futures
import signal

import pytest

from rlkjax.engine.engine import Engine
from tests.helpers import ENGINE_4, assert_bits_equal
from tests.server_process import engine_flags, metric, start_server, wait_for_metric

pytestmark = pytest.mark.slow  # starts a real server process


def test_a_small_request_finishes_long_before_a_big_one(tiny):
    """4 prompts x n=4 x 24 tokens fill the 4 batch slots (12 forks wait for a slot); a 2-token
    request then takes the next slot that frees. Before, the big request's waiting forks went
    first and the small one finished with the big one's last sequences (at --max-batch 16, a
    2-token request waited 94.5 s of a 172.6 s request)."""
    cfg, params = tiny
    proc, client = start_server(*engine_flags(ENGINE_4))
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            prompts = [[9, i + 1, 4, 4, 4] for i in range(4)]
            big = pool.submit(client.generate, prompts, n=4, max_tokens=24, seed=0, ignore_eos=True)
            wait_for_metric(client, "rlkjax_running_sequences", 4)
            wait_for_metric(client, "rlkjax_queue_depth", 1)  # the forks wait for a slot
            sent = metric(client, "rlkjax_engine_steps_total")
            small = client.generate([[7, 7, 7]], max_tokens=2, seed=99, ignore_eos=True)[0][0]
            small_steps = metric(client, "rlkjax_engine_steps_total") - sent
            assert not big.done(), "the big request finished first"
            samples = big.result()
            big_steps = metric(client, "rlkjax_engine_steps_total") - sent
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert all(len(s["tokens"]) == 24 for prompt in samples for s in prompt)
    # a slot frees after the leaders' 24 tokens (6 rounds of 4); the small request needs ~3 steps more
    assert small_steps < big_steps / 2, (small_steps, big_steps)
    engine = Engine(params, cfg, config=ENGINE_4)  # the server's engine: its programs are in the run's cache
    lone = engine.submit([7, 7, 7], max_tokens=2, seed=99)
    engine.run_until_done()
    alone = lone.results[0]
    assert small["tokens"] == alone.tokens
    assert_bits_equal(small["logprobs"], alone.logprobs, "small request over HTTP vs alone")
