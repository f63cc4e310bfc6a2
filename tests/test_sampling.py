"""Sampling semantics the OpenAI-style API exposes, under the bitwise contract: greedy decoding
(temperature 0), top logprobs per token (`top_logprobs=k`), prompt logprobs, min_tokens and
ignore_eos. Every logprob the sampler reports is the learner's (`rlkjax.score`) bit for bit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlkjax
from pallas_kernels import _math, logprob
from rlkjax.core import numerics
from rlkjax.engine.engine import Engine
from tests.helpers import ENGINE, INTERPRET, assert_bits_equal, bits, float64_on_cpu, randn, rel_err, slow

BF16, F32 = jnp.bfloat16, jnp.float32
CONFIG = numerics.LOGPROB


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


# ----- the sampler's noise -----
def test_gumbel_uniforms_are_never_0_or_1_for_any_bits():
    """Every value of the 23 bits the uniform keeps, with the low bits all set and all clear: u is in (0, 1)
    and strictly increasing in k, so the Gumbel noise is finite (u = 1 would give +inf, an arbitrary id)."""
    k = jnp.arange(1 << 23, dtype=jnp.uint32) << 9
    for raw in (k, k | jnp.uint32(0x1FF)):
        u = np.asarray(_math.uniform(raw))
        assert u.min() > 0 and u.max() < 1 and np.all(np.diff(u) > 0)
        assert np.isfinite(np.asarray(-_math.log(-_math.log(_math.uniform(raw))))).all()


# ----- greedy -----
def test_greedy_is_the_argmax_and_scores_at_temperature_one():
    """Temperature-0 rows draw argmax(logits) (never a Gumbel-perturbed id) and record the
    temperature-1 logprob, bit-equal to scoring the token at T = 1 (and at T = 0, the same)."""
    h, w = kernel_case()
    n = h.shape[0]
    temps = jnp.asarray(np.where(np.arange(n) % 3 == 0, 0.8, 0.0), F32)  # greedy rows mixed with sampled ones
    seeds, steps = jnp.arange(n, dtype=jnp.uint32), jnp.arange(n, dtype=jnp.int32)
    tokens, lp = logprob.head(h, w, temps, CONFIG, INTERPRET, seeds=seeds, steps=steps)[:2]
    tokens, lp, greedy = np.asarray(tokens), np.asarray(lp), np.asarray(temps) == 0
    z, err = logits64(h, w, temps), logits_error(h, w, temps)
    top2 = np.sort(z, axis=1)[:, -2:]
    clear = greedy & (top2[:, 1] - top2[:, 0] > 2 * err)  # no other id within the rounding error of the max
    assert clear.sum() >= greedy.sum() - 2, "the case must test most greedy rows"
    np.testing.assert_array_equal(tokens[clear], z[clear].argmax(axis=1))
    ones = jnp.where(temps == 0, 1.0, temps)
    for t in (ones, temps):  # scoring at T = 1 and at T = 0 is the same computation
        assert_bits_equal(
            lp, logprob.head(h, w, t, CONFIG, INTERPRET, targets=jnp.asarray(tokens)).logprobs, "greedy lp"
        )
    # Sampled rows are not greedy: over 13 rows some draw is not the argmax.
    assert (tokens[~greedy] != z[~greedy].argmax(axis=1)).any()


@pytest.mark.parametrize("tied,expected", [([290, 171, 170, 40], 40), ([290, 171, 170], 170), ([290], 290)])
def test_greedy_ties_go_to_the_lowest_id(tied, expected):
    """Ids whose lm_head rows are equal have equal logits: greedy must pick the lowest of them,
    whether they share a vocab tile (170, 171), sit in different tiles or vocab splits (40, 290;
    split 2 of a padded last tile). The same order holds in the top logprobs."""
    h, w = kernel_case(n=8)
    u = jnp.full((h.shape[1],), 0.5, BF16)  # a row every h (shifted positive) scores highest
    h = (jnp.abs(h.astype(F32)) + 0.25).astype(BF16)
    for i in tied:
        w = w.at[i].set(u)
    n = h.shape[0]
    temps = jnp.zeros(n, F32)
    keys = {"seeds": jnp.arange(n, dtype=jnp.uint32), "steps": jnp.zeros(n, jnp.int32)}
    tokens, lp, _, top_ids, top_lp = logprob.head(h, w, temps, CONFIG, INTERPRET, **keys, top_logprobs=6)
    np.testing.assert_array_equal(np.asarray(tokens), expected)
    np.testing.assert_array_equal(np.asarray(top_ids)[:, : len(tied)], np.sort(tied)[None, :].repeat(n, 0))
    assert (bits(np.asarray(top_lp)[:, : len(tied)]) == bits(np.asarray(lp))[:, None]).all()
    ref_tokens = logprob.head_reference(h, w, temps, **keys).tokens  # the fast path's argmax: the same rule
    np.testing.assert_array_equal(np.asarray(ref_tokens), expected)


def run(engine, *requests):
    """Submit (prompt, options) pairs together, run them to the end, return their first samples."""
    reqs = [engine.submit(prompt, max_tokens=6, **options) for prompt, options in requests]
    engine.run_until_done()
    return [r.results[0] for r in reqs]


def scored(params, cfg, prompts, comps, temps, **kw):
    """score() of every finished sequence in one call (a row's bits do not depend on the batch)."""
    return rlkjax.score(
        params, cfg, [p + c.tokens for p, c in zip(prompts, comps)], [len(p) for p in prompts], temps, **kw
    )


def test_greedy_rows_mixed_with_sampled_rows_and_scored_at_temperature_one(tiny):
    """Engine level: greedy rows share decode rounds with sampled rows and get the tokens and bits
    each gets alone (a greedy row whatever its seed); score(T=1) reproduces greedy logprobs."""
    cfg, params = tiny
    engine = Engine(params, cfg, config=ENGINE)
    prompts = [[1, 2, 3], list(range(40, 77)), [9, 8], [5] * 20]
    temps, seeds = [0.0, 0.7, 0.0, 1.3], [4, 5, 6, 7]
    mixed = run(engine, *[(p, dict(temperature=t, seed=s)) for p, t, s in zip(prompts, temps, seeds)])
    alone = [
        run(engine, (p, dict(temperature=t, seed=99 if t == 0 else s)))[0] for p, t, s in zip(prompts, temps, seeds)
    ]
    for i, (m, a) in enumerate(zip(mixed, alone)):
        assert a.tokens == m.tokens
        assert_bits_equal(a.logprobs, m.logprobs, f"row {i} (T={temps[i]}) alone vs mixed")
    for i, lp in enumerate(scored(params, cfg, prompts, mixed, [t or 1.0 for t in temps])):
        assert_bits_equal(lp, mixed[i].logprobs, f"row {i}: score vs generate")
    assert mixed[0].tokens != run(engine, (prompts[0], dict(temperature=1.0, seed=4)))[0].tokens, "greedy is not T=1"


# ----- top logprobs -----
def test_top_logprobs_are_the_top_k_of_the_same_distribution():
    """Per row: k ids in descending order of logprob, the same set as the float64 truth's top k
    (wherever the k-th and (k+1)-th truths are further apart than twice the logits' error bound),
    values as close to the truth as the fp32 XLA reference's (the rule of tests/test_kernels.py),
    and the drawn token's value, where it is listed, bit-equal to its recorded logprob."""
    h, w = kernel_case()
    n, k = h.shape[0], 8
    temps = jnp.asarray([0.0, 0.7, 1.0, 1.3] * 9 + [1.0], F32)
    seeds, steps = jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32)
    out = logprob.head(h, w, temps, CONFIG, INTERPRET, seeds=seeds, steps=steps, top_logprobs=k)
    tokens, lp, ids, top = (np.asarray(a) for a in (out.tokens, out.logprobs, out.top_ids, out.top_logprobs))
    assert (np.diff(top, axis=1) <= 0).all(), "top_logprobs sorted, most likely first"
    with float64_on_cpu():
        z = logits64(h, w, temps)
        logp64 = z - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)) - z.max(1, keepdims=True)
    order = np.argsort(-z, axis=1, kind="stable")
    z_sorted = np.take_along_axis(z, order, axis=1)
    clear = z_sorted[:, k - 1] - z_sorted[:, k] > 2 * logits_error(h, w, temps)
    assert clear.sum() >= n - 3, "the case must test most rows"
    for i in np.flatnonzero(clear):
        assert set(ids[i]) == set(order[i, :k]), f"row {i}: top-{k} set differs from the float64 truth's"
    top_ref = logprob.head_reference(h, w, temps, seeds=seeds, steps=steps, top_logprobs=k).top_logprobs
    truth = np.take_along_axis(logp64, ids, axis=1)
    ref = np.take_along_axis(np.asarray(jax.nn.log_softmax(logprob.logits_reference(h, w, temps), -1)), ids, axis=1)
    assert rel_err(top, truth) <= 2 * rel_err(ref, truth) + 1e-7
    assert rel_err(np.asarray(top_ref), np.sort(logp64, axis=1)[:, ::-1][:, :k]) < 1e-5  # the fast path's top_logprobs
    listed = ids == tokens[:, None]
    assert listed.any(axis=1).sum() >= n // 2
    rows, cols = np.nonzero(listed)
    np.testing.assert_array_equal(bits(top[rows, cols]), bits(lp[rows]))


@pytest.mark.slow  # the default run draws top_logprobs through the engine in test_top_k_draws_are_among_...
def test_generate_top_logprobs_equal_score_top_logprobs(tiny):
    """top_logprobs=k from the engine (decode rows, greedy and sampled, k per request) equal
    score(..., top_logprobs=k) over the finished sequences (the learner's rows), ids and bits; the
    drawn token's entry has its logprob's bits; tokens and logprobs are the default round's bits."""
    cfg, params = tiny
    engine = Engine(params, cfg, config=ENGINE)
    prompts, temps = [[1, 2, 3], list(range(60, 81))], [0.0, 0.9]
    options = [dict(temperature=t, seed=s) for t, s in zip(temps, (3, 4))]
    plain = run(engine, *zip(prompts, options))
    comps = run(
        engine, (prompts[0], options[0] | dict(top_logprobs=4)), (prompts[1], options[1] | dict(top_logprobs=2))
    )
    for i, (lp, ids, top) in enumerate(scored(params, cfg, prompts, comps, temps, top_logprobs=4)):
        c, k = comps[i], (4, 2)[i]
        assert c.tokens == plain[i].tokens and c.top_ids.shape == (6, k) and c.top_logprobs.dtype == np.float32
        assert_bits_equal(c.logprobs, plain[i].logprobs, "logprobs with vs without top logprobs")
        assert_bits_equal(lp, c.logprobs, "score vs generate")
        np.testing.assert_array_equal(ids[:, :k], c.top_ids)
        assert_bits_equal(top[:, :k], c.top_logprobs, "score top logprobs vs generate top logprobs")
        rows, cols = np.nonzero(c.top_ids == np.asarray(c.tokens)[:, None])
        assert_bits_equal(c.top_logprobs[rows, cols], c.logprobs[rows], "sampled token's entry")
    assert (comps[0].top_ids[:, 0] == comps[0].tokens).all(), "a greedy token is its own first top entry"


def test_prompt_logprobs_are_the_learners(tiny):
    """prompt_logprobs (what echo needs): the logprob of every prompt token after the first, bit-equal
    to score(prompt, prompt_lens=1), top_logprobs included; a 1-token prompt has none; the prompt
    inside its full sequence (causal attention) gives the same bits."""
    cfg, params = tiny
    prompts, temps = [[7, 8, 9, 10, 11], [3], list(range(100, 170))], [1.0, 0.0, 0.6]
    comps = rlkjax.generate(
        params, cfg, prompts, max_tokens=2, temperature=temps, sampling=rlkjax.SamplingParams(prompt_logprobs=3)
    )
    plain = rlkjax.score(params, cfg, prompts + [prompts[2] + comps[2].tokens], 1, temps + [0.6])
    for p, c, lp in zip(prompts, comps, plain):
        assert c.prompt_logprobs.shape == (len(p) - 1,) and c.prompt_top_ids.shape == (len(p) - 1, 3)
        assert_bits_equal(lp, c.prompt_logprobs, "prompt logprobs vs score")
        rows, cols = np.nonzero(c.prompt_top_ids == np.asarray(p[1:])[:, None])
        assert_bits_equal(c.prompt_top_logprobs[rows, cols], c.prompt_logprobs[rows], "prompt token's entry")
    assert_bits_equal(plain[3][: len(prompts[2]) - 1], comps[2].prompt_logprobs, "prompt within the full sequence")


# ----- min_tokens, ignore_eos -----
def stop_run(engine, prompt, **kw):
    req = engine.submit(prompt, max_tokens=10, temperature=0.0, **kw)
    engine.run_until_done()
    return req.results[0]


@pytest.mark.parametrize("decode_steps", [ENGINE.decode_steps, slow(1)])
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
    config = dataclasses.replace(ENGINE, decode_steps=decode_steps)
    plain, eos = Engine(params, cfg, config=config), Engine(params, cfg, config=config, eos_token_id=stop)

    def expect(comp, end, reason):
        assert comp.tokens == probe.tokens[: end + 1] and comp.finish_reason == reason, (comp.tokens, end, reason)
        assert_bits_equal(comp.logprobs, probe.logprobs[: end + 1], "same distribution")

    def end(min_tokens):  # the first stop with at least min_tokens tokens up to it, else max_tokens
        return next(((j, "stop") for j in later if j + 1 >= min_tokens), (9, "length"))

    for min_tokens in (0, later[1], later[1] + 1, later[-1] + 1, 10):
        expect(stop_run(plain, prompt, stop_token_ids=[stop], min_tokens=min_tokens), *end(min_tokens))
        expect(stop_run(eos, prompt, min_tokens=min_tokens), *end(min_tokens))
    expect(stop_run(eos, prompt, ignore_eos=True), 9, "length")
    expect(stop_run(eos, prompt, ignore_eos=True, stop_token_ids=[stop], min_tokens=2), *end(2))
    assert plain.pages.used == 0 and eos.pages.used == 0


# ----- top_k, top_p, min_p -----
def kept_reference(z, top_k, top_p, min_p):
    """The kept set in float64 by the rules of pallas_kernels/truncation.py, and the cumulative
    mass margin of the top_p cut (how far the cut is from flipping)."""
    order = np.argsort(-z, kind="stable")
    s = z[order]
    in_k = s >= s[(top_k or len(z)) - 1]
    p = np.where(in_k, np.exp(s - s[0]), 0.0)
    before = np.cumsum(p) - p
    cut = top_p * p.sum()
    kept_sorted = in_k & ((top_p >= 1) | (before < cut))
    thr = s[kept_sorted.sum() - 1]
    kept = (z >= thr) & (np.exp(z - s[0]) >= min_p)
    margin = np.inf if top_p >= 1 else np.abs(before[in_k] - cut).min() / p.sum()
    return kept, margin


TRUNCATIONS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 5, 1.0, 0.0),
    (0.7, 0, 0.6, 0.0),
    (1.3, 0, 1.0, 0.2),
    (1.0, 12, 0.8, 0.1),
    (0.5, 0, 0.95, 0.0),
]


def designed_case(draws):
    """One-hot hidden states pick lm_head column 0, whose bf16 values are the logits exactly:
    -rank / 16 over a random order of the 300 ids (ranks past 255 share -16), so the float64
    truth is exact and the kept sets are far from any rounding edge (checked)."""
    vocab, d = 300, 48
    rank = np.random.default_rng(0).permutation(vocab)
    z = np.maximum(-rank / 16.0, -16.0)
    w = np.zeros((vocab, d), np.float32)
    w[:, 0] = z
    h = np.zeros((draws * len(TRUNCATIONS), d), np.float32)
    h[:, 0] = 1.0
    return jnp.asarray(h, BF16), jnp.asarray(w, BF16), z


@pytest.mark.slow  # the default run's truncation kernel check: test_untruncated_rows_draw_the_default_tokens_and_bits
def test_truncated_sampling_keeps_the_reference_set_and_renormalises():
    """4,000 draws per setting (20,000 in all): no draw leaves the float64 reference's kept set, every
    kept id is drawn (each has >= 10 expected draws: the sets are equal), the counts fit the
    renormalised distribution (chi-square), the renormalised logprob matches the truth, and the
    full-distribution logprob is token_logprobs' bits (the learner's)."""
    draws = 4000
    h, w, z = designed_case(draws)
    cols = lambda i: jnp.asarray(np.repeat([c[i] for c in TRUNCATIONS], draws))  # noqa: E731
    temps, top_k, top_p, min_p = cols(0).astype(F32), cols(1).astype(jnp.int32), cols(2).astype(F32), cols(3)
    top_k = jnp.where(top_k == 0, w.shape[0], top_k)
    n = h.shape[0]
    seeds, steps = jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32)
    min_p = min_p.astype(F32)

    def by_setting(fn, *rows, w=w):
        """fn over each setting's 4,000 rows, outputs joined. One call over all 20,000 rows costs five times
        the work: an interpreted kernel copies its whole output at every grid step."""
        parts = [fn(*(a[j * draws : (j + 1) * draws] for a in rows), w) for j in range(len(TRUNCATIONS))]
        parts = [p if isinstance(p, tuple) else (p,) for p in parts]
        return [np.concatenate([np.asarray(p[i]) for p in parts]) for i in range(len(parts[0]))]

    def sampler(h, seeds, steps, temps, top_k, top_p, min_p, w):
        return logprob.head(h, w, temps, CONFIG, INTERPRET, seeds=seeds, steps=steps, truncation=(top_k, top_p, min_p))[
            :3
        ]

    def learner(h, tokens, temps, top_k, top_p, min_p, w):
        return logprob.head(h, w, temps, CONFIG, INTERPRET, targets=tokens, truncation=(top_k, top_p, min_p))[1:3]

    tokens, lp, renorm = by_setting(sampler, h, seeds, steps, temps, top_k, top_p, min_p)
    tokens_j = jnp.asarray(tokens)
    (full,) = by_setting(
        lambda h, x, t, w: logprob.head(h, w, t, CONFIG, INTERPRET, targets=x).logprobs, h, tokens_j, temps
    )
    assert_bits_equal(lp, full, "full lp")
    # The learner's side of the same rule: the drawn tokens score to the same bits, both ways, and
    # an id outside the kept set (the least likely one) scores -inf renormalised.
    full_t, renorm_t = by_setting(learner, h, tokens_j, temps, top_k, top_p, min_p)
    assert_bits_equal(full_t, lp, "learner full lp")
    assert_bits_equal(renorm_t, renorm, "learner renormalised lp")
    last = jnp.full(h.shape[0], int(np.argmin(z)), jnp.int32)
    assert (by_setting(learner, h, last, temps, top_k, top_p, min_p)[1] == -np.inf).all()
    for j, (t, k, p, m) in enumerate(TRUNCATIONS):
        rows = slice(j * draws, (j + 1) * draws)
        zt = z / t
        kept, margin = kept_reference(zt, k, p, m)
        ratio = np.exp(zt - zt.max())  # p / p_max, what min_p compares
        assert margin > 1e-4 and (m == 0 or np.abs(ratio - m).min() > 1e-4), "the case sits clear of rounding edges"
        probs = np.where(kept, np.exp(zt - zt.max()), 0.0)
        probs /= probs.sum()
        assert probs[kept].min() * draws >= 10, "every kept id must be likely enough to be drawn"
        counts = np.bincount(tokens[rows], minlength=len(z))
        assert set(np.flatnonzero(counts)) == set(np.flatnonzero(kept)), f"setting {j}: kept set"
        chi2 = ((counts[kept] - draws * probs[kept]) ** 2 / (draws * probs[kept])).sum()
        dof = kept.sum() - 1
        assert chi2 < dof + 5 * np.sqrt(2 * dof) + 5, (j, chi2, dof)
        # Renormalised logprob: the logits / T are within one fp32 rounding of the truth, and the
        # kept set's fp32 log-sum-exp sums at most 300 terms (relative error <= 300 * 2**-24):
        # 2e-5 nats bounds the difference with room for exp/log's few ulps.
        truth = np.log(probs[tokens[rows]])
        assert np.abs(renorm[rows] - truth).max() < 2e-5, j


def test_untruncated_rows_draw_the_default_tokens_and_bits():
    """A row with nothing truncated (top_k = vocab, top_p = 1, min_p = 0) in the truncation variant
    draws the default path's token with the same logprob bits (its noise and logits are the same),
    so rounds that mix truncated and plain rows leave the plain rows alone; its renormalised logprob
    is its full one up to rounding: both are logit - lse over the same ids, the two lse fp32 sums of
    the same exps in different orders (the truncation kernel's kept-set sum vs the fused kernel's
    online one), so they differ by a few fp32 ulps of terms of order 1-10 (~1e-6); atol 1e-5 leaves
    room for exp/log's own ulps, and a wrong kept set or a dropped tile is off by orders more."""
    h, w = kernel_case()
    n = h.shape[0]
    temps = jnp.asarray([0.0, 0.8, 1.0, 1.2] * 9 + [1.0], F32)
    seeds, steps = jnp.arange(n, dtype=jnp.uint32) * 7, jnp.arange(n, dtype=jnp.int32)
    nothing_truncated = (jnp.full(n, w.shape[0]), jnp.ones(n, F32), jnp.zeros(n, F32))
    keys = {"seeds": seeds, "steps": steps}
    tok, lp, renorm, ids, top = logprob.head(
        h, w, temps, CONFIG, INTERPRET, **keys, top_logprobs=3, truncation=nothing_truncated
    )
    tok0, lp0, _, ids0, top0 = logprob.head(h, w, temps, CONFIG, INTERPRET, **keys, top_logprobs=3)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(tok0))
    assert_bits_equal(lp, lp0, "truncation variant vs default")
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids0))
    assert_bits_equal(top, top0, "top_logprobs")
    np.testing.assert_allclose(np.asarray(renorm), np.asarray(lp), atol=1e-5)


@pytest.mark.slow  # the default run truncates through the engine in test_top_k_draws_are_among_the_top_top_logprobs
def test_generate_with_truncation(tiny):
    """Engine level: truncated rows record the full-distribution logprob (score's bits) or, asked,
    the renormalised one (<= 0, >= the full one) for the same tokens; a plain row sharing their
    rounds (the truncation variant) gets the tokens and bits it gets alone (the default variant)."""
    cfg, params = tiny
    engine = Engine(params, cfg, config=ENGINE)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    truncate = dict(temperature=1.0, seed=11, top_k=3, top_p=0.9, min_p=0.05)
    full, renorm, plain = run(
        engine,
        (prompts[0], truncate),
        (prompts[1], truncate | dict(truncated_logprobs=True)),
        (prompts[2], dict(seed=12)),
    )
    rounds = {key[:4] for name, key in engine.shapes_seen if name == "decode_round"}
    assert (8, 1, 0, True) in rounds, "the rows shared the truncation variant"
    alone = run(engine, (prompts[2], dict(seed=12)))[0]
    assert plain.tokens == alone.tokens
    assert_bits_equal(plain.logprobs, alone.logprobs, "plain row in truncation rounds vs alone")
    same = run(engine, (prompts[1], truncate))[0]
    assert same.tokens == renorm.tokens and (renorm.logprobs <= 0).all() and (renorm.logprobs >= same.logprobs).all()
    lps = scored(params, cfg, [prompts[0], prompts[1]], [full, same], 1.0)
    assert_bits_equal(lps[0], full.logprobs, "full lp vs score")
    assert_bits_equal(lps[1], same.logprobs, "full lp vs score")
    # The renormalised logprobs are the learner's too: score with the same truncation.
    options = dict(top_k=[3, 0], top_p=[0.9, 1.0], min_p=[0.05, 0.0], truncated_logprobs=True)
    lps = scored(params, cfg, [prompts[1], prompts[2]], [renorm, plain], [1.0, 1.0], **options)
    assert_bits_equal(lps[0], renorm.logprobs, "renormalised lp vs score(truncated_logprobs=True)")
    # Not a bitwise claim: with nothing truncated the renormalised lp is the full one up to the two lse
    # sums' rounding (the tolerance's derivation: test_untruncated_rows_draw_the_default_tokens_and_bits).
    np.testing.assert_allclose(lps[1], plain.logprobs, atol=1e-5)


@pytest.mark.parametrize("numerics_mode", ["strict", slow("fast")])
def test_top_k_draws_are_among_the_top_top_logprobs(tiny, numerics_mode):
    """top_k=3 with top_logprobs=3: every drawn token is one of the 3 listed top logprobs (ties
    aside, the kept set is the top 3), on the strict path and on the plain-XLA fast path (which
    runs the same rules in XLA: fast has every option strict has)."""
    cfg, params = tiny
    engine = Engine(params, cfg, numerics_mode, ENGINE)
    options = dict(top_k=3, top_logprobs=3)
    comps = run(engine, ([1, 2, 3], options | dict(temperature=1.3, seed=1)), ([4, 5], options | dict(temperature=0.0)))
    for c in comps:
        assert c.top_ids.shape == (6, 3) and (np.diff(c.top_logprobs, axis=1) <= 0).all()
        assert all(t in ids for t, ids in zip(c.tokens, c.top_ids)), (c.tokens, c.top_ids)
    assert (comps[1].top_ids[:, 0] == comps[1].tokens).all(), "greedy"


def test_cancelled_samples_keep_the_top_logprobs_shape(tiny):
    """A request with top_logprobs=k cancelled before it started still returns [0, k] arrays, so a
    server can format every sample the same way."""
    cfg, params = tiny
    engine = Engine(params, cfg, config=ENGINE)
    req = engine.submit(list(range(1, 40)), n=3, max_tokens=4, top_logprobs=2)
    engine.cancel(req)
    engine.run_until_done()
    assert [c.finish_reason for c in req.results] == ["cancelled"] * 3
    assert all(c.top_ids.shape == (0, 2) and c.top_logprobs.shape == (0, 2) for c in req.results)
