"""The learner's micro-batches packed by tokens (train/batch.py plan_micro_batches): every row once, within the
budget unless alone, few shapes, the rows put back in order; and a row's logprobs the same bits however the
rows are packed (the learner's own scoring and gradient programs)."""

import jax
import numpy as np
import pytest

from tests.helpers import assert_bits_equal
from train import fsdp
from train.batch import as_sample, micro_batches, micro_length, pack, plan_micro_batches, unpermute
from train.config import GRPOConfig
from train.learner import build_learner, gradients, score


def samples(prompt_lens, completion_lens, seed=0):
    rng = np.random.default_rng(seed)
    return [
        as_sample(
            rng.integers(0, 256, p).tolist(),
            rng.integers(0, 256, c).tolist(),
            rng.uniform(-6, -0.1, c).astype(np.float32),
            adv=float(rng.normal()),
            temperature=0.7,
        )
        for p, c in zip(prompt_lens, completion_lens)
    ]


def test_micro_lengths_are_few_and_pad_little():
    """Above 128 tokens, 8 lengths an octave: at most an eighth of padding, and never past the batch's own T
    (a run whose rows all reach the same length pads nothing more)."""
    lengths = {micro_length(n, 40_000) for n in range(1, 32_769)}
    assert len(lengths) < 100, len(lengths)
    for n in (129, 300, 1000, 4097, 4160, 20_000, 32_768):
        assert n <= micro_length(n, 40_000) <= n * 1.125 + 32, n
    assert micro_length(4160, 4160) == 4160 and micro_length(4100, 4160) == 4160


def test_plan_covers_every_row_once_within_the_budget():
    """Rows of 5 to 700 tokens at a budget of 512 tokens a device on 2 devices: every row in exactly one
    micro-batch, longest first; a micro-batch holds at most the budget a device, except a row longer than the
    budget, which runs alone (one row a device, the other device's row padding); a device's row count is the
    most of its length the budget holds, or a power of two."""
    lens = [5, 700, 40, 300, 90, 90, 130, 12, 256, 513, 64, 64, 64]
    batch = pack(samples([2] * len(lens), [n - 2 for n in lens]))
    plan = plan_micro_batches(batch, budget=512, devices=2)
    seen = np.concatenate([mb.rows for mb in plan])
    assert sorted(seen) == list(range(len(lens)))
    assert [lens[i] for i in seen] == sorted(lens, reverse=True)
    for mb in plan:
        per_device = mb.size // 2
        assert mb.size % 2 == 0 and (per_device == max(1, 512 // mb.length) or per_device & (per_device - 1) == 0)
        assert max(lens[i] for i in mb.rows) <= mb.length
        assert per_device * mb.length <= 512 or per_device == 1, mb
    long = [mb for mb in plan if mb.length > 512]
    assert [list(mb.rows) for mb in long] == [[1, 9]] and long[0].size == 2  # one row on each device
    with pytest.raises(ValueError, match="budget of 0"):
        plan_micro_batches(batch, 0)


def test_micro_batches_cut_and_put_back():
    """Each micro-batch holds its rows' tokens, cut to its length and scored columns, padded with empty rows;
    unpermute puts per-micro-batch arrays back in the batch's row order."""
    batch = pack(samples([3, 40, 7, 150], [4, 9, 30, 2]))
    plan = list(micro_batches(batch, budget=64))
    for mb, part in plan:
        t = mb.length
        assert part.tokens.shape == (mb.size, t) and part.logp_old.shape == (mb.size, t - 1)
        assert np.array_equal(part.tokens[: len(mb.rows)], batch.tokens[mb.rows, :t])
        assert np.array_equal(part.mask[: len(mb.rows)], batch.mask[mb.rows, : t - 1])
        assert np.all(batch.mask[mb.rows, t - 1 :] == 0)  # nothing trained was cut
        kept = part.columns[: len(mb.rows)]
        assert np.array_equal(kept[kept >= 0], batch.columns[mb.rows][batch.columns[mb.rows] >= 0])
        assert np.all(part.positions[len(mb.rows) :] == -1)
    back = unpermute([part.logp_old for _, part in plan], [mb for mb, _ in plan], *batch.logp_old.shape)
    assert np.array_equal(back, batch.logp_old)


@pytest.mark.slow  # compiles the tiny learner's scoring and gradient programs at three shapes
def test_a_rows_logprobs_do_not_depend_on_the_packing(tiny):
    """The learner's scoring pass and its gradient step (train/learner.py score and gradients) over one batch
    of 9- to 30-token rows at a token budget that packs them all in one micro-batch and at one that runs every
    row alone (the 20- and 30-token rows over it): every row's logprobs have the same bits (compared as
    uint32), and the step's are the scoring pass's. Three shapes in all, each compiled once per program."""
    cfg, params = tiny
    batch = pack(samples([4, 10, 3, 8], [8, 20, 6, 12], seed=3))
    learner, master, _ = build_learner(GRPOConfig(micro_batch_tokens=1, remat="off"), cfg, params, jax.devices()[:1])
    total = fsdp.put(np.float32(batch.mask.sum()), learner.mesh, fsdp.REPLICATED)
    sel = batch.mask > 0
    scored, stepped = {}, {}
    for budget in (1024, 16):
        scored[budget] = score(learner, master, batch, budget)[sel]
        config = GRPOConfig(micro_batch_tokens=budget, remat="off")
        _, _, _, logp_new = gradients(learner, master, None, batch, total, config)
        stepped[budget] = learner.unpermute(batch, budget, logp_new)[sel]
    assert len(plan_micro_batches(batch, 1024)) == 1 and len(plan_micro_batches(batch, 16)) == len(batch.tokens)
    assert_bits_equal(scored[16], scored[1024], "scored row by row vs all in one micro-batch")
    assert_bits_equal(stepped[16], stepped[1024], "learner step row by row vs all in one micro-batch")
    assert_bits_equal(stepped[1024], scored[1024], "learner step vs scoring pass")
    assert np.all(np.isfinite(scored[1024])) and np.all(scored[1024] < 0)
