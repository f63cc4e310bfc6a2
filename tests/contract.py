"""The bitwise contract, as a reusable check: the CPU tests run it on qwen3-tiny, the GPU tests
(`pytest -m gpu`) on qwen3-0.6b and qwen3-8b shapes."""

import numpy as np

import rlkjax
from tests.helpers import assert_bits_equal

TEMPERATURES = (0.7, 1.0, 1.3)


def random_case(rng, cfg, max_batch=9, max_len=70):
    b = int(rng.integers(1, max_batch + 1))
    prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(1, max_len + 1))).tolist() for _ in range(b)]
    seeds = rng.integers(0, 2**32, b).tolist()
    temps = rng.choice(TEMPERATURES, b).tolist()
    return prompts, seeds, temps


def check_case(params, cfg, prompts, seeds, temps, max_new, chunk, rng, numerics="strict"):
    """score == generate bit for bit; rows alone == rows in the batch, for both."""
    comps = rlkjax.generate(
        params,
        cfg,
        prompts,
        max_new_tokens=max_new,
        temperature=temps,
        seeds=seeds,
        numerics=numerics,
        prefill_chunk_size=chunk,
    )
    seqs = [p + c.tokens for p, c in zip(prompts, comps)]
    lens = [len(p) for p in prompts]
    scored = rlkjax.score(params, cfg, seqs, lens, temperature=temps, numerics=numerics)
    for i, (c, s) in enumerate(zip(comps, scored)):
        assert len(c.tokens) == max_new and c.logprobs.dtype == np.float32
        assert np.all(np.isfinite(c.logprobs)) and np.all(c.logprobs <= 0)
        assert_bits_equal(s, c.logprobs, f"row {i}: score vs generate (prompt {lens[i]}, T={temps[i]}, chunk {chunk})")
    # A row alone, with another chunk size: same tokens, same bits; scored alone: same bits.
    for i in rng.choice(len(prompts), min(2, len(prompts)), replace=False):
        other_chunk = int(rng.choice([5, 16, 64]))
        alone = rlkjax.generate(
            params,
            cfg,
            [prompts[i]],
            max_new_tokens=max_new,
            temperature=temps[i],
            seeds=seeds[i],
            numerics=numerics,
            prefill_chunk_size=other_chunk,
        )[0]
        assert alone.tokens == comps[i].tokens, f"row {i}: tokens differ alone vs batched"
        assert_bits_equal(alone.logprobs, comps[i].logprobs, f"row {i}: generate alone vs batched")
        assert_bits_equal(
            rlkjax.score(params, cfg, [seqs[i]], [lens[i]], temperature=temps[i], numerics=numerics)[0],
            scored[i],
            f"row {i}: score alone vs batched",
        )
    return sum(len(c.tokens) for c in comps)
