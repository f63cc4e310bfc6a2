"""Sampling semantics the OpenAI-style API exposes, under the bitwise contract: greedy decoding
(temperature 0), top alternatives per token (`top_logprobs=k`), prompt logprobs, min_tokens and
ignore_eos. Every logprob the sampler reports is the learner's (`rlkjax.score`) bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlkjax
from pallas_kernels import logprob
from rlkjax import numerics
from rlkjax.engine import Engine, EngineConfig
from tests.conftest import assert_bits_equal, bits
from tests.test_kernels import INTERPRET, float64_on_cpu, randn, rel_err

BF16, F32 = jnp.bfloat16, jnp.float32
CONFIG = numerics.LOGPROB
ENGINE = EngineConfig(num_pages=64, max_batch=8, prefill_chunk=16, token_budget=32, max_context=128, decode_steps=4)


def kernel_case(n=37, d=48, vocab=300):
    """bf16 hidden states and lm_head of an odd shape (a padded K step and a padded vocab tile)."""
    return randn(1, (n, d), BF16), randn(2, (vocab, d), BF16, 0.3)


def logits64(h, w, temps):
    """The float64 truth of logits / T (T = 0: greedy, the temperature-1 logits)."""
    t = np.where(np.asarray(temps) == 0, 1.0, np.asarray(temps, np.float64))
    return (np.asarray(h, np.float64) @ np.asarray(w, np.float64).T) / t[:, None]


def logits_error(h, w, temps):
    """A bound on |fp32 kernel logit - float64 truth| per row: the bf16 products are exact in fp32,
    and D fp32 additions each round by at most 2**-24 of the running sum, <= sum |h_i w_i|."""
    t = np.where(np.asarray(temps) == 0, 1.0, np.asarray(temps, np.float64))
    mag = np.abs(np.asarray(h, np.float64)) @ np.abs(np.asarray(w, np.float64)).T
    return h.shape[1] * 2.0**-24 * mag.max(axis=1) / t


# ----- greedy -----
def test_greedy_is_the_argmax_and_scores_at_temperature_one():
    """Temperature-0 rows draw argmax(logits) (never a Gumbel-perturbed id) and record the
    temperature-1 logprob, bit-equal to scoring the token at T = 1 (and at T = 0, the same)."""
    h, w = kernel_case()
    n = h.shape[0]
    temps = jnp.asarray(np.where(np.arange(n) % 3 == 0, 0.8, 0.0), F32)  # greedy rows mixed with sampled ones
    seeds, steps = jnp.arange(n, dtype=jnp.uint32), jnp.arange(n, dtype=jnp.int32)
    tokens, lp = logprob.sample_tokens(h, w, seeds, steps, temps, CONFIG, INTERPRET)
    tokens, lp, greedy = np.asarray(tokens), np.asarray(lp), np.asarray(temps) == 0
    z, err = logits64(h, w, temps), logits_error(h, w, temps)
    top2 = np.sort(z, axis=1)[:, -2:]
    clear = greedy & (top2[:, 1] - top2[:, 0] > 2 * err)  # no other id within the rounding error of the max
    assert clear.sum() >= greedy.sum() - 2, "the case must test most greedy rows"
    np.testing.assert_array_equal(tokens[clear], z[clear].argmax(axis=1))
    ones = jnp.where(temps == 0, 1.0, temps)
    for t in (ones, temps):  # scoring at T = 1 and at T = 0 is the same computation
        assert_bits_equal(lp, logprob.token_logprobs(h, w, jnp.asarray(tokens), t, CONFIG, INTERPRET), "greedy lp")
    # Sampled rows are not greedy: over 13 rows some draw is not the argmax.
    assert (tokens[~greedy] != z[~greedy].argmax(axis=1)).any()


@pytest.mark.parametrize("tied,expected", [([290, 171, 170, 40], 40), ([290, 171, 170], 170), ([290], 290)])
def test_greedy_ties_go_to_the_lowest_id(tied, expected):
    """Ids whose lm_head rows are equal have equal logits: greedy must pick the lowest of them,
    whether they share a vocab tile (170, 171), sit in different tiles or vocab splits (40, 290;
    split 2 of a padded last tile). The same order holds in the top alternatives."""
    h, w = kernel_case(n=8)
    u = jnp.full((h.shape[1],), 0.5, BF16)  # a row every h (shifted positive) scores highest
    h = (jnp.abs(h.astype(F32)) + 0.25).astype(BF16)
    for i in tied:
        w = w.at[i].set(u)
    n = h.shape[0]
    temps = jnp.zeros(n, F32)
    args = (h, w, jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32), temps)
    tokens, lp, top_ids, top_lp = logprob.sample_tokens_with_alternatives(*args, 6, CONFIG, INTERPRET)
    np.testing.assert_array_equal(np.asarray(tokens), expected)
    np.testing.assert_array_equal(np.asarray(top_ids)[:, : len(tied)], np.sort(tied)[None, :].repeat(n, 0))
    assert (bits(np.asarray(top_lp)[:, : len(tied)]) == bits(np.asarray(lp))[:, None]).all()
    ref_tokens, _ = logprob.sample_tokens_reference(*args)  # the fast path's argmax: the same rule
    np.testing.assert_array_equal(np.asarray(ref_tokens), expected)


def test_greedy_generate_equals_score_at_temperature_one_and_mixed_batches(tiny):
    """Engine level: greedy rows in a batch with sampled rows (one decode round holds both) give
    the tokens and bits each gets alone, and score(T=1) reproduces greedy logprobs bit for bit."""
    cfg, params = tiny
    prompts = [[1, 2, 3], list(range(40, 77)), [9, 8], [5] * 20]
    temps, seeds = [0.0, 0.7, 0.0, 1.3], [4, 5, 6, 7]
    mixed = rlkjax.generate(params, cfg, prompts, max_new_tokens=6, temperature=temps, seeds=seeds)
    for i in range(len(prompts)):
        alone = rlkjax.generate(params, cfg, [prompts[i]], max_new_tokens=6, temperature=temps[i], seeds=99)[0]
        if temps[i] == 0:  # a greedy row does not depend on its seed either
            assert alone.tokens == mixed[i].tokens
            assert_bits_equal(alone.logprobs, mixed[i].logprobs, f"greedy row {i} alone vs mixed")
        scored = rlkjax.score(params, cfg, [prompts[i] + mixed[i].tokens], [len(prompts[i])], temperature=temps[i] or 1)
        assert_bits_equal(scored[0], mixed[i].logprobs, f"row {i}: score vs generate")
    sampled_alone = rlkjax.generate(params, cfg, [prompts[1]], max_new_tokens=6, temperature=0.7, seeds=5)[0]
    assert sampled_alone.tokens == mixed[1].tokens
    assert_bits_equal(sampled_alone.logprobs, mixed[1].logprobs, "sampled row alone vs mixed with greedy rows")


# ----- top alternatives -----
def test_alternatives_are_the_top_k_of_the_same_distribution():
    """Per row: k ids in descending order of logprob, the same set as the float64 truth's top k
    (wherever the k-th and (k+1)-th truths are further apart than twice the logits' error bound),
    values as close to the truth as the fp32 XLA reference's (the rule of tests/test_kernels.py),
    and the drawn token's value, where it is listed, bit-equal to its recorded logprob."""
    h, w = kernel_case()
    n, k = h.shape[0], 8
    temps = jnp.asarray([0.0, 0.7, 1.0, 1.3] * 9 + [1.0], F32)
    seeds, steps = jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32)
    tokens, lp, ids, top = (
        np.asarray(a) for a in logprob.sample_tokens_with_alternatives(h, w, seeds, steps, temps, k, CONFIG, INTERPRET)
    )
    assert (np.diff(top, axis=1) <= 0).all(), "alternatives sorted, most likely first"
    with float64_on_cpu():
        z = logits64(h, w, temps)
        logp64 = z - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)) - z.max(1, keepdims=True)
    order = np.argsort(-z, axis=1, kind="stable")
    z_sorted = np.take_along_axis(z, order, axis=1)
    clear = z_sorted[:, k - 1] - z_sorted[:, k] > 2 * logits_error(h, w, temps)
    assert clear.sum() >= n - 3, "the case must test most rows"
    for i in np.flatnonzero(clear):
        assert set(ids[i]) == set(order[i, :k]), f"row {i}: top-{k} set differs from the float64 truth's"
    _, _, _, top_ref = logprob.sample_tokens_with_alternatives_reference(h, w, seeds, steps, temps, k)
    truth = np.take_along_axis(logp64, ids, axis=1)
    ref = np.take_along_axis(np.asarray(jax.nn.log_softmax(logprob._logits_reference(h, w, temps), -1)), ids, axis=1)
    assert rel_err(top, truth) <= 2 * rel_err(ref, truth) + 1e-7
    assert rel_err(np.asarray(top_ref), np.sort(logp64, axis=1)[:, ::-1][:, :k]) < 1e-5  # the fast path's alternatives
    listed = ids == tokens[:, None]
    assert listed.any(axis=1).sum() >= n // 2
    rows, cols = np.nonzero(listed)
    np.testing.assert_array_equal(bits(top[rows, cols]), bits(lp[rows]))


def test_generate_alternatives_equal_score_alternatives(tiny):
    """top_logprobs=k from generate (decode rows, mixed greedy and sampled, k per request) equal
    score(..., top_logprobs=k) over the finished sequence (the learner's rows), ids and bits; the
    sampled token's entry has its logprob's bits; the logprobs are the default path's bits."""
    cfg, params = tiny
    prompts, temps, seeds = [[1, 2, 3], list(range(60, 81))], [0.0, 0.9], [3, 4]
    plain = rlkjax.generate(params, cfg, prompts, max_new_tokens=5, temperature=temps, seeds=seeds)
    comps = rlkjax.generate(params, cfg, prompts, max_new_tokens=5, temperature=temps, seeds=seeds, top_logprobs=4)
    for p, t, c, c0 in zip(prompts, temps, comps, plain):
        assert c.tokens == c0.tokens and c.top_ids.shape == (5, 4) and c.top_logprobs.dtype == np.float32
        assert_bits_equal(c.logprobs, c0.logprobs, "logprobs with vs without alternatives")
        lp, ids, top = rlkjax.score(params, cfg, [p + c.tokens], [len(p)], temperature=t, top_logprobs=4)[0]
        assert_bits_equal(lp, c.logprobs, "score vs generate")
        np.testing.assert_array_equal(ids, c.top_ids)
        assert_bits_equal(top, c.top_logprobs, "score alternatives vs generate alternatives")
        rows, cols = np.nonzero(c.top_ids == np.asarray(c.tokens)[:, None])
        assert_bits_equal(c.top_logprobs[rows, cols], c.logprobs[rows], "sampled token's entry")
    assert (comps[0].top_ids[:, 0] == comps[0].tokens).all(), "a greedy token is its own first alternative"


def test_prompt_logprobs_are_the_learners(tiny):
    """prompt_logprobs (what echo needs): the logprob of every prompt token after the first, bit-equal
    to score(prompt, prompt_lens=1), with and without alternatives; a 1-token prompt has none."""
    cfg, params = tiny
    prompts, temps = [[7, 8, 9, 10, 11], [3], list(range(100, 170))], [1.0, 0.0, 0.6]
    comps = rlkjax.generate(params, cfg, prompts, max_new_tokens=2, temperature=temps, prompt_logprobs=3)
    bare = rlkjax.generate(params, cfg, prompts[:1], max_new_tokens=2, prompt_logprobs=0)[0]
    assert bare.prompt_top_ids is None
    assert_bits_equal(bare.prompt_logprobs, comps[0].prompt_logprobs, "prompt logprobs with vs without alternatives")
    for p, t, c in zip(prompts, temps, comps):
        assert c.prompt_logprobs.shape == (len(p) - 1,) and c.prompt_top_ids.shape == (len(p) - 1, 3)
        assert_bits_equal(rlkjax.score(params, cfg, [p], [1], temperature=t)[0], c.prompt_logprobs, "prompt logprobs")
        rows, cols = np.nonzero(c.prompt_top_ids == np.asarray(p[1:])[:, None])
        assert_bits_equal(c.prompt_top_logprobs[rows, cols], c.prompt_logprobs[rows], "prompt token's entry")
    # The same prompt inside a longer sequence (causal attention): the same bits.
    whole = rlkjax.score(params, cfg, [prompts[2] + comps[2].tokens], [1], temperature=0.6)[0]
    assert_bits_equal(whole[: len(prompts[2]) - 1], comps[2].prompt_logprobs, "prompt within the full sequence")


# ----- min_tokens, ignore_eos -----
def stop_run(engine, prompt, **kw):
    req = engine.submit(prompt, max_new_tokens=10, temperature=0.0, **kw)
    engine.run_until_done()
    return req.results[0]


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_min_tokens_and_ignore_eos(tiny, decode_steps):
    """A stop id (or the engine's EOS) drawn before min_tokens is kept as an ordinary token and the
    sample goes on: the completion is the unconstrained one cut at the first stop at or after
    min_tokens, with the same logprob bits (the distribution is never changed). ignore_eos drops
    the EOS, not the request's own stop ids. Mid-round and across rounds alike."""
    cfg, params = tiny
    prompt = [1, 2, 3]
    probe = stop_run(Engine(params, cfg, config=ENGINE), prompt)
    stop = probe.tokens[0]  # the greedy tiny model repeats tokens: this id comes back later
    later = [j for j, t in enumerate(probe.tokens) if t == stop]
    assert len(later) >= 3, probe.tokens
    config = EngineConfig(**{**ENGINE.__dict__, "decode_steps": decode_steps})
    plain, eos = Engine(params, cfg, config=config), Engine(params, cfg, config=config, eos_token_id=stop)

    def expect(comp, end, reason):
        assert comp.tokens == probe.tokens[: end + 1] and comp.finish_reason == reason, (comp.tokens, end, reason)
        assert_bits_equal(comp.logprobs, probe.logprobs[: end + 1], "same distribution")

    def end(min_tokens):  # the first stop with at least min_tokens tokens up to it, else max_new_tokens
        return next(((j, "stop") for j in later if j + 1 >= min_tokens), (9, "length"))

    for min_tokens in (0, later[1], later[1] + 1, later[-1] + 1, 10):
        expect(stop_run(plain, prompt, stop_token_ids=[stop], min_tokens=min_tokens), *end(min_tokens))
        expect(stop_run(eos, prompt, min_tokens=min_tokens), *end(min_tokens))
    expect(stop_run(eos, prompt, ignore_eos=True), 9, "length")
    expect(stop_run(eos, prompt, ignore_eos=True, stop_token_ids=[stop], min_tokens=2), *end(2))
    assert plain.pages.used == 0 and eos.pages.used == 0
