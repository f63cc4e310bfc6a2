"""ROCm without an AMD GPU: the strict programs export for ROCm (gfx942) on a CPU machine and pass the
same HLO audits as CUDA's (the control), and the ROCm tile table keeps the contract where it can be
run here (interpreted). What only an AMD GPU can show (bits on the MFMA units, speed) is left to
bench/rocm_check.sh; what the Triton compiler makes of the kernels: tests/test_rocm_compile.py.
Prevents: a strict program that cannot be lowered for ROCm, or lowers with XLA arithmetic, dots or
combining scatters there (XLA's ROCm pipeline differs from CUDA's), found only on the day an MI300X is
at hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlkjax
from rlkjax.core import audit, model, numerics
from rlkjax.core.numerics import NumericsOptions
from rlkjax.engine import programs
from tests.helpers import assert_bits_equal, slow
from train.batch import Batch
from train.loss import Objective, grpo_loss


def strict_programs(cfg, options, b=2, t=16, pages=4, steps=4):
    """{name: (jitted, args, kwargs)}: the sampler's decode step and round (the engine's next_round:
    decode_round continuing the round in flight), the learner's logprobs and its step (grpo_loss and
    its gradient), on abstract inputs."""
    S = jax.ShapeDtypeStruct
    params = jax.eval_shape(lambda: model.init_params(cfg))
    master = jax.eval_shape(lambda: model.init_params(cfg, dtype=jnp.float32))
    rope = jax.tree.map(lambda a: S(a.shape, a.dtype), model.rope_tables(cfg))
    cache = jax.eval_shape(lambda: model.init_kv_cache(cfg, 1 + b * pages))
    pt, one, vec = S((b, pages), jnp.int32), S((b, 1), jnp.int32), lambda dt: S((b,), dt)
    i32 = vec(jnp.int32)
    sampling = programs.RowSampling(vec(jnp.uint32), i32, vec(jnp.float32), i32, S((b, 2), jnp.int32), i32)
    carry = (S((2 * b,), jnp.int32), S((2 * b,), jnp.bool_))
    round_args = (params, programs.RoundStart(carry, i32, i32), i32, cache, pt, sampling, rope)
    tok, per_token = S((b, t), jnp.int32), S((b, t - 1), jnp.float32)
    batch = Batch(tok, tok, per_token, per_token, vec(jnp.float32), vec(jnp.float32), per_token)
    rope_tables = model.rope_tables(cfg)

    def learner_step(master, batch):
        loss = jax.value_and_grad(grpo_loss, has_aux=True)
        return loss(master, batch, None, rope_tables, 100.0, Objective(model.LearnerPass(cfg, options), 0.2, 0.0))

    logprobs = jax.jit(model.sequence_logprobs, static_argnames="setting")
    seqs, setting = model.Sequences(tok, tok, vec(jnp.float32)), model.LearnerPass(cfg, options)
    decoding = programs.Decoding(cfg, options)
    return {
        "decode_step": (programs.decode_step, (params, one, one, cache, pt, sampling, rope, decoding), {}),
        "learner_logprobs": (logprobs, (params, seqs, rope, setting), {}),
        "decode_round": (programs.next_round, (*round_args, programs.Decoding(cfg, options, num_steps=steps)), {}),
        "learner_step": (jax.jit(learner_step), (master, batch), {}),
    }


@pytest.mark.parametrize("program", ["decode_step", "decode_round", "learner_logprobs", "learner_step"])
# CUDA is the control; the default run audits CUDA's lowering in tests/test_hlo_audit.py.
@pytest.mark.parametrize("platform", ["rocm", slow("cuda")])
def test_strict_programs_export_and_pass_the_audits(tiny, platform, program):
    """jax.export for ROCm with an abstract gfx942 (CUDA with an abstract H200: the control), each on
    its platform's tile table: the Triton kernels are there, and outside them no XLA dot and no
    combining scatter, and on the logprob path (all but the loss arithmetic of the learner step) no
    float arithmetic."""
    cfg = tiny[0]
    jitted, args, kwargs = strict_programs(cfg, NumericsOptions(platform=platform))[program]
    text = audit.export_for_gpu(jitted, *args, platform=platform, **kwargs)
    assert "__gpu$xla.gpu.triton" in text
    if program != "learner_step":  # the loss (ratios, clipping) is XLA arithmetic after the logprobs
        assert audit.float_arithmetic(text) == []
    assert audit.xla_dots(text) == []
    assert audit.combining_scatters(text) == []


def test_rocm_table_fits_lds_and_one_mfma_shape():
    """The table's own arithmetic (the compiled facts are tests/test_rocm_compile.py's): every matmul
    on the logprob path within gfx942's 64 KiB of LDS by (stages - 1) x (A + B tile) in bf16, and tile
    M and N >= 32 everywhere, where Triton's AMD backend picks one MFMA shape (32x32) for all of them."""
    t = numerics.ROCM_TILES
    matmuls = [t.matmul_decode, t.matmul_small, t.matmul_medium, t.matmul, t.logprob.backward]
    for c in matmuls:
        assert (c.num_stages - 1) * (c.block_m + c.block_n) * c.block_k * 2 <= 64 * 1024, c
        assert min(c.block_m, c.block_n) >= 32, c
    lp = t.logprob
    assert (lp.num_stages - 1) * (lp.block_rows + lp.block_vocab) * lp.block_k * 2 <= 64 * 1024
    assert min(lp.block_rows, lp.block_vocab) >= 32
    assert numerics.padded_rows(1, NumericsOptions(platform="rocm")) == 32  # decode pads to the 32-row tile


def test_rocm_table_keeps_the_contract_interpreted(tiny):
    """The sampler's recorded logprobs equal the learner's, bit for bit, on the ROCm table run by the
    interpreter (CPU): the table is a consistent one (decode's 32-row tiles and padding, its logprob
    config on both sides). It cannot show what the MFMA units do: that needs an AMD GPU."""
    cfg, params = tiny
    rocm = NumericsOptions(tiles=numerics.ROCM_TILES)  # the platform stays the CPU's: interpreted
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    comps = rlkjax.generate(params, cfg, prompts, max_tokens=4, temperature=1.0, seeds=[0, 1], numerics=rocm)
    lps = rlkjax.score(params, cfg, [p + c.tokens for p, c in zip(prompts, comps)], [3, 7], numerics=rocm)
    for c, lp in zip(comps, lps):
        assert len(c.tokens) == 4
        assert_bits_equal(np.asarray(c.logprobs), lp, "sampler vs learner on the ROCm table")


def test_rocm_plugin_no_gpu_traceback_is_kept_from_screens(caplog):
    """With `.[rocm]` installed, JAX logs the plugin's "No AMD GPUs were found" ValueError with a
    traceback on every machine without one (seen with jax-rocm7-plugin 0.11.2, JAX_PLATFORMS=cpu);
    `import rlkjax` filters exactly that record. Any other plugin error still shows."""
    import logging

    logger = logging.getLogger("jax._src.xla_bridge")
    for message in ("No AMD GPUs were found, skipping ROCm plugin initialization", "libamdhip64.so not found"):
        try:
            raise ValueError(message)
        except ValueError:
            logger.exception("Jax plugin configuration error: Exception when calling %s.initialize()", "xla_rocm7")
    shown = [r.exc_info[1].args[0] for r in caplog.records if r.exc_info]
    assert shown == ["libamdhip64.so not found"]
