"""The bitwise contract on CPU (interpret mode): sampler logprobs == learner logprobs, exactly,
for random prompt sets, batch sizes, temperatures and prefill chunk sizes; every row the same
alone or batched. Prevents: any batch-, chunk- or position-dependent reduction on the strict path."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlkjax
from rlkjax.core import numerics
from rlkjax.engine.config import EngineConfig
from tests.contract import BATCH_SIZES, check_case, random_case
from tests.helpers import ENGINE, ODD

# The engine `generate` sizes for the default case's batches of 9 at chunk 37 (9 rows in a bucket of
# 16, every batch holding one 70-token prompt + 6 new tokens: 76 tokens, 32 pages in all): the slow
# cases run their lone rows on it, so they find the default case's programs.
GENERATE_37 = EngineConfig(num_pages=32, max_batch=16, prefill_chunk=37, token_budget=16 * 37, max_context=76)


# chunk 37 (not a page multiple) runs by default, through `generate`; 16 with the slow tests (.ci/run
# runs both), on the engine the engine tests build (tests/helpers.py ENGINE: chunk 16, 8 batch slots,
# so a batch of 9 also queues a row), whose programs the run compiles anyway, and with its lone rows
# at chunk 37 on the default case's engine (it compiled 41 programs when it sampled through
# `generate`'s engines for batches of 3 and 9 and ran its lone rows at chunk 5). The default run
# draws batches of 9 only: `generate` sizes its engine (KV pages, batch buckets) by the batch, and
# the batches of 3 added two more engines' programs (with them the test took 135 CPU seconds,
# without 97); every batch of 9 still runs prefill calls of 1 to 16 rows, and decode rounds of 16
# rows with 1 to 9 of them live (Engine.min_decode_rows), against lone rows on an engine of one row.
# The slow run draws both sizes.
@pytest.mark.parametrize(
    "chunk,batch_sizes,engine,alone",
    [pytest.param(16, BATCH_SIZES, ENGINE, GENERATE_37, marks=pytest.mark.slow), (37, (9,), None, None)],
    ids=["16", "37"],
)
def test_score_equals_generate_bitwise(tiny, chunk, batch_sizes, engine, alone):
    cfg, params = tiny
    rng = np.random.default_rng(chunk)
    compared = 0
    for _ in range(5):
        prompts, seeds, temps = random_case(rng, cfg, batch_sizes=batch_sizes)
        compared += check_case(params, cfg, prompts, seeds, temps, 6, chunk, engine=engine, alone=alone)
    assert compared > 0


@pytest.mark.slow
def test_edge_lengths(tiny):
    """Prompt lengths at and around the page size, length 1, and a batch of 9 (on the engines of
    test_score_equals_generate_bitwise[16])."""
    cfg, params = tiny
    rng = np.random.default_rng(1)
    lens = [1, 15, 16, 17, 31, 32, 33, 64, 70]
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lens]
    check_case(params, cfg, prompts, list(range(9)), [0.7, 1.0, 1.3] * 3, 5, 16, engine=ENGINE, alone=GENERATE_37)


@pytest.mark.slow
@pytest.mark.parametrize("table", ["shipped", "row sums as products"])
def test_contract_across_kv_splits(tiny, table):
    """The contract where a row's keys span several KV splits: 16-key splits of 16-key blocks, so a
    70-token prompt and its 6 new tokens span 5 splits. The sampler's decode steps and 16-token
    prefill chunks merge their splits in the merge kernel, the learner's 76-token rows in the
    attention kernel; rows of 70, 33, 17 and 1 prompt tokens side by side, the longest and the
    shortest alone with 5-token chunks. On the shipped attention table, and on the one whose row sums
    are products (numerics.ATTENTION_LONG_ROWS), where the learner's rows run 64-row query tiles
    against the decode steps' 16. Prevents: a split structure, merge order or split count that
    differs between decode and the learner's pass, or depends on the neighbours; a row-sum order
    that follows the query tile."""
    cfg, params = tiny
    tiles = numerics.NumericsOptions().resolved().tiles
    base = tiles.attention if table == "shipped" else numerics.ATTENTION_LONG_ROWS
    attention = dataclasses.replace(base, kv_split=16, block_pages=1)
    options = numerics.NumericsOptions(tiles=dataclasses.replace(tiles, attention=attention))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (70, 33, 17, 1)]
    check_case(params, cfg, prompts, [1, 2, 3, 4], [0.7, 1.0, 1.3, 1.0], max_new=6, chunk=16, numerics=options)


@pytest.mark.slow
def test_fast_path_is_the_same_model_to_bf16_accuracy(tiny):
    """numerics='fast' (plain XLA) computes the same model, not the same bits. Tolerance, derived
    rather than picked: score the same sequences with the model evaluated in float32 (the truth up
    to float32 rounding, ~1e-7 here) and require each bf16 path's error against it to be within 2x
    of the other's (measured: both 0.003-0.004 nats, the bf16 rounding of activations). Prevents a
    fast path that silently computes another model (a wrong rounding point or temperature would
    be off by far more), while the always-run comparison cannot be skipped by unlucky draws."""
    cfg, params = tiny
    cfg32, params32 = cfg.replace_dtype("float32"), jax.tree.map(lambda w: w.astype(jnp.float32), params)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, cfg.vocab_size, int(rng.integers(8, 60))).tolist() for _ in range(5)]
    lens, temps = [3] * 5, [0.7, 1.0, 1.3, 1.0, 0.7]
    truth = rlkjax.score(params32, cfg32, seqs, lens, temperature=temps, numerics="fast")
    errors = {}
    for mode in ("strict", "fast"):
        got = rlkjax.score(params, cfg, seqs, lens, temperature=temps, numerics=mode)
        errors[mode] = max(float(np.abs(g - t).max()) for g, t in zip(got, truth))
    assert 0 < errors["strict"] <= 2 * errors["fast"] and errors["fast"] <= 2 * errors["strict"], errors
    comps = rlkjax.generate(
        params, cfg, [[3, 1, 4, 1, 5], list(range(40))], max_tokens=4, seeds=[1, 2], numerics="fast"
    )
    assert all(len(c.tokens) == 4 and np.all(np.isfinite(c.logprobs)) and np.all(c.logprobs <= 0) for c in comps)


@pytest.mark.slow
def test_odd_shapes_bitwise():
    """The contract at a shape every kernel pads (bf16): width 40, group size 3, head dim 24 (RoPE
    halves of 12), FFN 37, vocab 300 (a padded vocab tile). Prevents: padding that depends on the
    batch or the chunk (a padded query head or vocab id leaking into a real row's reduction)."""
    cfg = ODD
    params = rlkjax.init_params(cfg, seed=5)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (3, 17, 30)]
    check_case(params, cfg, prompts, [1, 2, 3], [0.7, 1.0, 1.3], max_new=4, chunk=16)


@pytest.mark.slow
def test_layer_unroll_keeps_bits(tiny):
    """NumericsOptions.layer_unroll (bench.speed --layer-unroll) only changes how many layers one iteration of
    the sampler's layer loop runs: the same kernels on the same inputs, so the hidden states and the
    KV cache keep their bits."""
    from rlkjax.core import model
    from rlkjax.core.numerics import NumericsOptions
    from tests.helpers import assert_bits_equal

    cfg, params = tiny
    rope = model.rope_tables(cfg)
    tokens = jnp.arange(2 * 9, dtype=jnp.int32).reshape(2, 9) % cfg.vocab_size
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    page_table = jnp.array([[1], [2]], jnp.int32)
    runs = []
    for unroll in (1, 2):
        cache = model.init_kv_cache(cfg, 3)
        options = NumericsOptions(layer_unroll=unroll)
        runs.append(model.forward(params, tokens, positions, cache, page_table, rope, cfg, options))
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1]), strict=True):
        assert_bits_equal(a, b, "unroll 2 vs 1")
