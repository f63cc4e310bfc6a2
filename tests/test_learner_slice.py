"""The learner scores completions only (model.completion_logprobs): the log-softmax over the vocabulary,
forward and backward, runs at the columns the loss reads, with the bits the full pass has there.
Prevents: a sliced learner whose logprobs drift from the sampler's, whose gradient differs from the
full pass's, or whose backward brings back the scatter-add a gather's transpose is."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlkjax
from rlkjax.core import audit, model
from tests.helpers import STRICT, assert_bits_equal
from train.batch import PAD, micro_batches, pack
from train.loss import Objective, grpo_loss, policy_logprobs


def samples(rng, prompt_lengths, completion_lengths, vocab, temperatures=(1.0, 0.7, 0.0, 1.3)):
    return [
        {
            "prompt": rng.integers(0, vocab, p).tolist(),
            "tokens": rng.integers(0, vocab, c).tolist(),
            "logprobs": rng.uniform(-7, -0.1, c).astype(np.float32),
            "adv": float(a),
            "temperature": temp,
        }
        for p, c, a, temp in zip(prompt_lengths, completion_lengths, (1.0, -0.5, 0.25, -1.0), temperatures)
    ]


def test_pack_lists_each_rows_completion_columns():
    """Column t predicts token t + 1: a completion of n tokens after a prompt of p is read at columns
    p - 1 .. p + n - 2, exactly where the mask is 1; the rest of the row's list is -1, as padding rows'."""
    rng = np.random.default_rng(0)
    batch = pack(samples(rng, (3, 5), (3, 2), 100))
    assert batch.columns.shape == (2, 4)  # the longest completion's power of two
    np.testing.assert_array_equal(batch.columns, [[2, 3, 4, -1], [4, 5, -1, -1]])
    for row, mask in zip(batch.columns, batch.mask):
        np.testing.assert_array_equal(row[row >= 0], np.flatnonzero(mask))
    assert PAD.columns == -1


@pytest.mark.parametrize("numerics", ["strict", "fast"])
def test_completion_logprobs_have_the_full_passs_bits(tiny, numerics):
    """At every completion column the sliced pass gives the full pass's bits (in strict numerics the
    sampler's, by the contract the full pass is tested on), with greedy and tempered rows, prompts of
    different lengths and a row whose completion is one token; every other column holds 0."""
    cfg, params = tiny
    batch = pack(samples(np.random.default_rng(1), (7, 30, 2, 12), (9, 1, 20, 5), cfg.vocab_size))
    rope = model.rope_tables(cfg)
    fn = jax.jit(model.sequence_logprobs, static_argnames="setting")
    seqs, setting = model.Sequences(batch.tokens, batch.positions, batch.temps), model.LearnerPass(cfg, numerics)
    full = np.asarray(fn(params, seqs, rope, setting))
    sliced = np.asarray(fn(params, seqs._replace(columns=batch.columns), rope, setting))
    sel = batch.mask > 0
    assert_bits_equal(sliced[sel], full[sel], "completion columns, sliced vs full")
    assert np.all(sliced[~sel] == 0)


def loss_and_grads(master, batch, cfg):
    rope = model.rope_tables(cfg)
    total = float(batch.mask.sum())
    ref = jnp.zeros(batch.logp_old.shape, jnp.float32)

    def loss(m, b):
        return grpo_loss(m, b, ref, rope, total, Objective(model.LearnerPass(cfg, "strict"), clip_eps=0.2, beta=0.1))

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(master, batch)


def assert_gradients_match_the_full_pass(master, batch, cfg):
    (loss, (_, logp)), grads = loss_and_grads(master, batch, cfg)
    (full_loss, (_, full_logp)), full_grads = loss_and_grads(master, batch._replace(columns=None), cfg)
    assert_bits_equal(np.asarray(loss), np.asarray(full_loss), "loss")
    sel = batch.mask > 0
    assert_bits_equal(np.asarray(logp)[sel], np.asarray(full_logp)[sel], "logp_new")
    head = "embed_tokens" if cfg.tie_embeddings else "lm_head"
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(full_grads)):
        name, got, want = jax.tree_util.keystr(path), np.asarray(got), np.asarray(want)
        if head in name:  # equal bits allowed, not promised
            step = np.spacing(np.abs(want).astype(jnp.bfloat16)).astype(np.float32)  # one bf16 step at each value
            assert np.all(np.abs(got - want) <= 2 * step), name
        else:
            assert_bits_equal(got, want, name)


def test_gradients_are_the_full_passs(tiny):
    """The GRPO loss (with a KL term, so the reference's scoring pass is sliced too), its logp_new and
    the gradient of every weight but the head have the full pass's bits: the hidden states' cotangent
    is the same (the loss puts 0 on unscored columns; the sliced pass stores 0 there). The head's
    gradient (tied: the embedding's) sums the same scored rows' products over fewer rows, grouped into
    other tiles of the fp32 accumulation, then rounds to bf16 (the policy's dtype) and, tied, adds the
    embedding's own bf16 gradient. Both fp32 sums lie within about K * 2^-24 relative of the exact
    value (K = 4 x 15 scored rows here), far below bf16's 2^-9 half step, so each bf16 rounding can
    land at most on the neighbouring value: at most one bf16 step apart per rounding, two in all.
    Bit-equal layer gradients need the backward's vocabulary chunk (logprob.vocab_chunk) to be the same
    for both row counts: interpreted (here) it is fixed; compiled for a GPU it is sized by the row count,
    and with many rows the full pass sums the hidden states' cotangent over more chunks and the last
    bits differ."""
    cfg, params = tiny
    master = jax.tree.map(lambda w: w.astype(jnp.float32), params)
    batch = pack(samples(np.random.default_rng(2), (7, 30, 2, 12), (9, 1, 20, 5), cfg.vocab_size))  # a greedy row too
    assert_gradients_match_the_full_pass(master, batch, cfg)


def test_micro_batches_score_as_the_whole_batch(tiny):
    """Rows sliced into micro-batches (and padded with PAD rows, whose columns are all -1) score the
    same bits as the whole batch: a row's columns index its own row."""
    cfg, params = tiny
    batch = pack(samples(np.random.default_rng(3), (7, 30, 2, 12), (9, 1, 20, 5), cfg.vocab_size))
    rope = model.rope_tables(cfg)
    fn = jax.jit(policy_logprobs, static_argnames="setting")
    master = jax.tree.map(lambda w: w.astype(jnp.float32), params)
    strict = model.LearnerPass(cfg, "strict")
    whole = np.asarray(
        fn(master, model.Sequences(batch.tokens, batch.positions, batch.temps, batch.columns), rope, strict)
    )
    parts = [
        np.asarray(fn(master, model.Sequences(mb.tokens, mb.positions, mb.temps, mb.columns), rope, strict))[:3]
        for mb in micro_batches(batch, 3, devices=2)
    ]
    assert_bits_equal(np.concatenate(parts)[: len(whole)], whole, "micro-batches of 3 rows, padded to 4")


def lowered_learner(cfg, grad: bool, columns: bool, b=2, t=16, c=8):
    rope = model.rope_tables(cfg)
    tok, temps = jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.float32)
    cols = jax.ShapeDtypeStruct((b, c), jnp.int32) if columns else None

    def logprobs(params, tokens, positions, temperature, columns):
        seqs = model.Sequences(tokens, positions, temperature, columns)
        return model.sequence_logprobs(params, seqs, rope, model.LearnerPass(cfg, STRICT))

    fn = jax.grad(lambda *a: logprobs(*a).sum()) if grad else logprobs
    return audit.lower_for_gpu(jax.jit(fn), jax.eval_shape(lambda: rlkjax.init_params(cfg)), tok, tok, temps, cols)


def float_ops(text):
    """The kinds of float arithmetic op outside the kernels (stablehlo.add, ...)."""
    return {
        re.search(r"(stablehlo|chlo)\.\w+", line.split("=", 1)[1]).group(0) for line in audit.float_arithmetic(text)
    }


def test_sliced_learner_passes_the_audits(tiny):
    """Lowered for the audited GPU: the sliced forward has no float arithmetic outside our kernels;
    its gradient has no combining scatter (the gather's gradient is a plain store) and no XLA dot,
    and no float arithmetic op the full pass's gradient does not have (take_rows and put_rows add none)."""
    cfg = tiny[0]
    forward = lowered_learner(cfg, grad=False, columns=True)
    assert "__gpu$xla.gpu.triton" in forward and audit.float_arithmetic(forward) == []
    sliced, full = lowered_learner(cfg, grad=True, columns=True), lowered_learner(cfg, grad=True, columns=False)
    assert audit.combining_scatters(sliced) == [] and audit.xla_dots(sliced) == []
    assert float_ops(sliced) <= float_ops(full), (float_ops(sliced), float_ops(full))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-8b"])
def test_sliced_learner_compiled(preset):
    """On a GPU (Triton kernels) at real Qwen3 shapes: the sliced learner has the sampler's bits on
    every completion token (prompts of 5 to 300 tokens, three of attention's KV splits) and its
    optimised HLO has no float arithmetic outside the kernels."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    cfg = rlkjax.ModelConfig.preset(preset)
    params = rlkjax.init_params(cfg, seed=0)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (37, 150, 5, 300)]
    comps = rlkjax.generate(params, cfg, prompts, max_tokens=16, temperature=1.0, seeds=[0, 1, 2, 3])
    batch = pack(
        [
            {"prompt": p, "tokens": c.tokens, "logprobs": c.logprobs, "adv": float(a), "temperature": 1.0}
            for p, c, a in zip(prompts, comps, (1.0, -0.5, 0.25, -1.0))
        ]
    )
    rope = model.rope_tables(cfg)
    fn = jax.jit(model.sequence_logprobs, static_argnames="setting")
    seqs = model.Sequences(batch.tokens, batch.positions, batch.temps, batch.columns)
    args = (params, seqs, rope, model.LearnerPass(cfg, "strict"))
    logp = np.asarray(fn(*args))
    sel = batch.mask > 0
    assert_bits_equal(logp[sel], batch.logp_old[sel], f"{preset}: sliced learner vs sampler")
    bad = audit.float_arithmetic_hlo(fn.lower(*args).compile().as_text())
    assert not bad, "float arithmetic outside the kernels:\n" + "\n".join(bad)
