"""The bitwise contract, as a reusable check: the CPU tests run it on qwen3-tiny, the GPU tests
(`pytest -m gpu`) on qwen3-0.6b and qwen3-8b shapes."""

import dataclasses

import numpy as np

import rlkjax
from rlkjax.core.shapes import bucket
from rlkjax.engine.config import EngineConfig
from rlkjax.engine.engine import Engine
from tests.helpers import assert_bits_equal

TEMPERATURES = (0.7, 1.0, 1.3)


# Batch sizes and prompt lengths are drawn from small fixed sets, so that the cases of one test
# repeat a few programs (each new batch bucket, page count or context length compiles every step
# function again, tens of seconds in interpret mode) while still mixing odd lengths, page edges
# (16, 17, 33), a one-token prompt and chunk boundaries. Every batch holds one prompt of max_len:
# the engine's context, and so its page table, is the same in every case.
BATCH_SIZES = (3, 9)
PROMPT_LENS = (1, 7, 16, 17, 33, 50)


def random_case(rng, cfg, max_len=70, batch_sizes=BATCH_SIZES):
    b = int(rng.choice(batch_sizes))
    lens = [max_len, *rng.choice(PROMPT_LENS, b - 1)]
    rng.shuffle(lens)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in lens]
    seeds = rng.integers(0, 2**32, b).tolist()
    temps = rng.choice(TEMPERATURES, b).tolist()
    return prompts, seeds, temps


def check_case(params, cfg, prompts, seeds, temps, max_new, chunk, numerics="strict", engine=None, alone=None):
    """score == generate bit for bit; rows alone == rows in the batch, for both.

    engine: an EngineConfig to sample the batch on instead of the one `generate` sizes for it (its
    prefill_chunk is the chunk); alone: the EngineConfig the lone rows run on (default: the one
    `generate` sizes for the longest row alone, with another chunk size). A test passes the engines
    other tests build, so that the run compiles their programs once."""
    if engine is None:
        comps = rlkjax.generate(
            params,
            cfg,
            prompts,
            max_tokens=max_new,
            temperature=temps,
            seeds=seeds,
            numerics=numerics,
            prefill_chunk_size=chunk,
        )
    else:
        assert engine.prefill_chunk == chunk, (engine, chunk)
        batched = Engine(params, cfg, numerics, engine)
        requests = [
            batched.submit(p, max_tokens=max_new, temperature=t, seed=s) for p, t, s in zip(prompts, temps, seeds)
        ]
        batched.run_until_done()
        comps = [r.results[0] for r in requests]
    seqs = [p + c.tokens for p, c in zip(prompts, comps)]
    lens = [len(p) for p in prompts]
    scored = rlkjax.score(params, cfg, seqs, lens, temperature=temps, numerics=numerics)
    for i, (c, s) in enumerate(zip(comps, scored)):
        assert len(c.tokens) == max_new and c.logprobs.dtype == np.float32
        assert np.all(np.isfinite(c.logprobs)) and np.all(c.logprobs <= 0)
        assert_bits_equal(s, c.logprobs, f"row {i}: score vs generate (prompt {lens[i]}, T={temps[i]}, chunk {chunk})")
    # The longest and the shortest row alone, with another chunk size: same tokens, same bits;
    # scored alone: same bits. (Fixed choices: each chunk size and each lone row's length bucket
    # compiles programs of its own.) Both run on one engine (by default the one `generate` sizes for
    # the longest row alone): one engine per row length would compile every step function again for each.
    if alone is None:
        sizing = EngineConfig.for_batch([max(lens) + max_new], 5 if chunk == 16 else 16)
        alone = dataclasses.replace(sizing, num_pages=bucket(sizing.num_pages))
    assert alone.prefill_chunk != chunk, (alone, chunk)
    lone = Engine(params, cfg, numerics, alone)
    for i in sorted({int(np.argmax(lens)), int(np.argmin(lens))}):
        request = lone.submit(prompts[i], max_tokens=max_new, temperature=temps[i], seed=seeds[i])
        lone.run_until_done()
        result = request.results[0]
        assert result.tokens == comps[i].tokens, f"row {i}: tokens differ alone vs batched"
        assert_bits_equal(result.logprobs, comps[i].logprobs, f"row {i}: generate alone vs batched")
        assert_bits_equal(
            rlkjax.score(params, cfg, [seqs[i]], [lens[i]], temperature=temps[i], numerics=numerics)[0],
            scored[i],
            f"row {i}: score alone vs batched",
        )
    return sum(len(c.tokens) for c in comps)
