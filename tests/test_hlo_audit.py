"""The strict path, lowered for a GPU (an H200 on a machine without one), has no floating-point
arithmetic outside our Pallas (Triton) custom calls: XLA only moves data. Prevents: an
innocent-looking jnp op on the logprob path (a cast, a scale, an add) that XLA would fuse
differently in the sampler and the learner."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

import rlkjax
from rlkjax.core import audit, embedding, lora, model
from rlkjax.core.config import LoraConfig
from rlkjax.engine import programs
from tests.helpers import ODD, STRICT, slow


def abstract(make):
    """The shapes and dtypes of what make() returns, traced, not computed (no program compiles)."""
    return jax.eval_shape(make)


def model_params(cfg):
    """Random params of cfg, with its LoRA adapters (in the model's dtype, as the policy holds them) if any."""
    params = rlkjax.init_params(cfg)
    if cfg.lora is None:
        return params
    return lora.merge(params, jax.tree.map(lambda w: w.astype(cfg.dtype), lora.init_adapters(cfg)))


def lowered(cfg, fn, numerics_mode, b=2, t=16, pages=4):
    params = abstract(lambda: model_params(cfg))
    rope = abstract(lambda: model.rope_tables(cfg))
    tok = jax.ShapeDtypeStruct((b, t), jnp.int32)
    seqs = model.Sequences(tok, tok, jax.ShapeDtypeStruct((b,), jnp.float32))
    learner = jax.jit(model.sequence_logprobs, static_argnames="setting")
    if fn == "learner":
        return audit.lower_for_gpu(learner, params, seqs, rope, model.LearnerPass(cfg, numerics_mode))
    if fn == "learner_truncation":  # score(..., truncated_logprobs=True)
        trunc = (jax.ShapeDtypeStruct((b,), jnp.int32),) + (jax.ShapeDtypeStruct((b,), jnp.float32),) * 2
        seqs = seqs._replace(truncation=trunc)
        return audit.lower_for_gpu(learner, params, seqs, rope, model.LearnerPass(cfg, numerics_mode))
    if fn == "learner_top_logprobs":  # prompt logprobs with top logprobs (score(..., top_logprobs=k))
        setting = model.LearnerPass(cfg, numerics_mode, top_logprobs=5)
        return audit.lower_for_gpu(learner, params, seqs, rope, setting)
    cache = abstract(lambda: model.init_kv_cache(cfg, 1 + b * pages))
    pt = jax.ShapeDtypeStruct((b, pages), jnp.int32)
    one = jax.ShapeDtypeStruct((b, 1), jnp.int32)
    vec = lambda dt: jax.ShapeDtypeStruct((b,), dt)  # noqa: E731
    stops = jax.ShapeDtypeStruct((b, 2), jnp.int32)
    truncation = (vec(jnp.int32), vec(jnp.float32), vec(jnp.float32), vec(jnp.bool_))
    sampling = programs.RowSampling(
        vec(jnp.uint32),
        vec(jnp.int32),
        vec(jnp.float32),
        vec(jnp.int32),
        stops,
        vec(jnp.int32),
        truncation if fn == "sampler_round_truncation" else None,
    )
    if fn in ("sampler", "sampler_top_logprobs"):
        decoding = programs.Decoding(cfg, numerics_mode, top_logprobs=20 if fn == "sampler_top_logprobs" else 0)
        return audit.lower_for_gpu(programs.decode_step, params, one, one, cache, pt, sampling, rope, decoding)
    carry = (jax.ShapeDtypeStruct((2 * b,), jnp.int32), jax.ShapeDtypeStruct((2 * b,), jnp.bool_))
    start = programs.RoundStart(carry, vec(jnp.int32), vec(jnp.int32))
    k = 20 if fn in ("sampler_round_top_logprobs", "sampler_round_truncation") else 0
    decoding = programs.Decoding(cfg, numerics_mode, num_steps=4, top_logprobs=k)
    # the engine's round: decode_round continuing the round in flight
    return audit.lower_for_gpu(programs.next_round, params, start, vec(jnp.int32), cache, pt, sampling, rope, decoding)


# The default run audits the odd shape (every kernel pads it); qwen3-tiny's runs with the slow tests.
@pytest.mark.parametrize("shape", [slow("tiny"), "odd"])
@pytest.mark.parametrize(
    "fn",
    ["learner", "sampler", "sampler_round"]
    + ["learner_top_logprobs", "sampler_top_logprobs", "sampler_round_top_logprobs"]
    + ["sampler_round_truncation", "learner_truncation"],
)
def test_strict_path_has_no_xla_float_arithmetic(tiny, fn, shape):
    """Also the variants with top logprobs and truncation: their logits kernel's output goes
    through XLA's top_k (selection only) and gathers, then back into kernels for every exp, sum,
    cumulative mass, log and subtraction."""
    cfg = tiny[0] if shape == "tiny" else ODD
    text = lowered(cfg, fn, STRICT)
    assert "__gpu$xla.gpu.triton" in text  # the kernels really are there
    assert audit.float_arithmetic(text) == []
    if fn.endswith(("top_logprobs", "truncation")):
        assert "chlo.top_k" in text or "stablehlo.sort" in text


@pytest.mark.parametrize("fn", ["learner", "sampler", "sampler_round"])
def test_lora_strict_path_has_no_xla_float_arithmetic(fn):
    """With adapters on every projection (rank 4: the kernels pad it; alpha 12: a scale that is no power of two),
    the adapted projections run in kernels too: XLA only slices the adapters out of their stacks."""
    cfg = dataclasses.replace(ODD, lora=LoraConfig(rank=4, alpha=12.0))
    text = lowered(cfg, fn, STRICT)
    assert "_lora" in text  # the adapted kernels really are there
    assert audit.float_arithmetic(text) == []


def test_lora_adapter_gradient_runs_in_kernels():
    """The adapters' gradient (what the LoRA learner computes; the base frozen) has no XLA dot and no combining
    scatter: every product in our kernels, every sum in a fixed order."""
    cfg = dataclasses.replace(ODD, lora=LoraConfig(rank=4, alpha=12.0))
    rope = model.rope_tables(cfg)
    tok = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    base, adapters = lora.split(abstract(lambda: model_params(cfg)))

    def total(adapters, base, tokens, positions, temperature):
        params = lora.merge(base, adapters)
        seqs = model.Sequences(tokens, positions, temperature)
        return model.sequence_logprobs(params, seqs, rope, model.LearnerPass(cfg, STRICT)).sum()

    temps = jax.ShapeDtypeStruct((2,), jnp.float32)
    text = audit.lower_for_gpu(jax.jit(jax.grad(total)), adapters, base, tok, tok, temps)
    assert "_lora" in text
    assert audit.xla_dots(text) == []
    assert audit.combining_scatters(text) == []


def test_audit_reads_chlo_ops():
    """chlo ops are audited too (chlo.top_k is listed as selection; an unlisted one is flagged)."""
    line = "%0 = chlo.erf %arg0 : tensor<4xf32> -> tensor<4xf32>"
    assert audit.float_arithmetic(line) == [line]
    assert audit.float_arithmetic("%v, %i = chlo.top_k(%arg0, k = 4) : tensor<4x300xf32> -> (...)") == []


def test_audit_catches_the_fast_path(tiny):
    """The audit is not vacuous: the plain-XLA path is full of float arithmetic."""
    cfg, _ = tiny
    bad = audit.float_arithmetic(lowered(cfg, "learner", "fast"))
    assert any("dot_general" in line for line in bad) and any("exponential" in line for line in bad)


@functools.cache
def learner_gradient(cfg, numerics_mode, b=2, t=16):
    """The learner's gradient (of its sequence logprobs), lowered for the audited GPU (once: two tests
    audit the same text)."""
    rope = model.rope_tables(cfg)
    tok = jax.ShapeDtypeStruct((b, t), jnp.int32)
    temps = jax.ShapeDtypeStruct((b,), jnp.float32)

    def total(params, tokens, positions, temperature):
        seqs = model.Sequences(tokens, positions, temperature)
        return model.sequence_logprobs(params, seqs, rope, model.LearnerPass(cfg, numerics_mode)).sum()

    return audit.lower_for_gpu(jax.jit(jax.grad(total)), abstract(lambda: rlkjax.init_params(cfg)), tok, tok, temps)


def test_learner_gradient_has_no_atomic_adds(tiny):
    """The strict learner's gradient has no scatter that adds where an index repeats (a GPU runs
    those as atomic adds, in an order that changes from run to run; the embedding gradient of
    repeated tokens was one: bf16 atomics). embedding.embed sums repeats in a fixed order instead. The
    KV writes stay scatters, but they overwrite: each real position once, padding onto the trash page."""
    text = learner_gradient(tiny[0], STRICT)
    assert '"stablehlo.scatter"' in text  # the audit sees the scatters that are there
    assert audit.combining_scatters(text) == []


def test_learner_gradient_has_no_xla_dots(tiny):
    """The strict learner's gradient runs every matrix product in our kernels: XLA's autotuner picks
    its own dots' algorithms per compilation by timing, and on 2 H200s two processes got gradients
    that differed in the last bits from one process (2026-11-30) while the attention backward was
    XLA's dense one. The flash backward (default) has no XLA dot; the dense one does (not vacuous)."""
    assert audit.xla_dots(learner_gradient(tiny[0], STRICT)) == []
    dense = dataclasses.replace(STRICT, attention_backward="dense")
    assert len(audit.xla_dots(learner_gradient(tiny[0], dense))) >= 2


def test_combining_scatter_audit_catches_a_plain_gather_gradient():
    """Not vacuous: the gradient of plain indexing is the scatter-add the audit flags."""
    ids = jnp.array([3, 1, 3], jnp.int32)
    table = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    text = audit.lower_for_gpu(jax.jit(jax.grad(lambda t: t[ids].sum())), table)
    assert len(audit.combining_scatters(text)) == 1
    text = audit.lower_for_gpu(jax.jit(jax.grad(lambda t: embedding.embed(t, ids).sum())), table)
    assert audit.combining_scatters(text) == []
