"""What several test files share: exact bit comparisons, the odd model shape every kernel pads, and the
kernel tests' float64 truth and random inputs.
(Fixtures and pytest's hooks live in conftest.py, which test files do not import.)"""

import contextlib
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlkjax
from rlkjax.core import audit
from rlkjax.core.numerics import NumericsOptions
from rlkjax.engine.config import EngineConfig

INTERPRET = jax.default_backend() == "cpu"  # Pallas kernels run interpreted on the CPU, compiled on a GPU
# The strict path on the audited GPU's tile table (this machine's GPU, or CUDA's on a machine without one),
# for programs lowered through Triton, not the interpreter (rlkjax.core.audit).
STRICT = NumericsOptions(platform=audit.target_platform())


# The engine the in-process tests build, one config wherever a test's property does not depend on it:
# each config compiles every step function afresh (its KV cache, page table, batch buckets and round
# length are part of each program), tens of seconds in interpret mode. tests/server_process.py starts
# its servers with the same settings, so an engine here finds the programs a server compiled (and
# the other way round) in the run's compilation cache.
# A completion math-verify takes minutes to check (it compares a million-factorial with the reference):
# a check of it runs past any timeout a test sets, however slowly the test's own process runs.
SLOW_ANSWER = "\\boxed{(10^{6})!}"

ENGINE = EngineConfig(num_pages=128, max_batch=8, prefill_chunk=16, token_budget=32, max_context=256, decode_steps=4)
# Half the batch slots, for the tests that fill every slot (fair turns, parked forks): only the decode
# rounds compile again (their carry is max_batch rows); prefill and page copies are ENGINE's.
ENGINE_4 = dataclasses.replace(ENGINE, max_batch=4)
# Too few pages for the load the tests give it: sequences are preempted and recomputed.
ENGINE_TIGHT = dataclasses.replace(ENGINE, num_pages=12, max_batch=4)


def slow(*values):
    """A parametrize case that runs with the slow tests (.ci/run), not in plain `pytest`."""
    return pytest.param(*values, marks=pytest.mark.slow)


def fake_devices(n: int) -> dict[str, str]:
    """The environment for a subprocess on n fake CPU devices: this run's XLA_FLAGS (the strict flag,
    the suite's optimisation level) plus the device count."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count=")]
    return os.environ | {"XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])}


def rel_err(x, truth):
    x, truth = np.asarray(x, np.float64), np.asarray(truth, np.float64)
    return np.linalg.norm(x - truth) / np.linalg.norm(truth)


@contextlib.contextmanager
def float64_on_cpu():
    """The float64 truth is computed on the host CPU (GPU BLAS has no float64->float32 GEMMs)."""
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        yield


def randn(key, shape, dtype=jnp.float32, scale=1.0):
    """Normal values drawn and rounded on the host (numpy; bfloat16 through ml_dtypes), then put on the
    device: with jax.random each new shape compiled its own programs (the draw, the scale, the cast)."""
    x = (np.float32(scale) * np.random.default_rng(key).standard_normal(shape, np.float32)).astype(dtype)
    return jnp.asarray(x)


def bits(a) -> np.ndarray:
    """Bit pattern of a float array, for exact comparisons."""
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_bits_equal(a, b, what=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    diff = int((bits(a) != bits(b)).sum())
    assert diff == 0, (
        f"{what}: {diff} of {a.size} values differ in their bits "
        f"(max |diff| {np.abs(a.astype(np.float64) - b.astype(np.float64)).max()})"
    )


# A shape every kernel pads, like the tiny random Qwen3 models on the Hub: width 40, group size 3,
# head dim 24 (RoPE halves of 12), FFN 37, vocab 300 (a padded vocab tile).
ODD = rlkjax.ModelConfig(
    vocab_size=300,
    hidden_size=40,
    num_layers=1,
    num_heads=6,
    num_kv_heads=2,
    head_dim=24,
    intermediate_size=37,
    tie_embeddings=False,
    max_position=256,
)


EOS = 256  # the byte tokenizer's (rlkjax.text.tokenizer.ByteTokenizer)


def eos_model(directory):
    """The tiny model made to draw the byte tokenizer's eos (256) often, saved as an HF checkpoint.

    Why it draws eos: residual channel 0 is set to 1 in every token's embedding, and no layer writes to
    it (row 0 of every o_proj and down_proj is zero), so at every position x_0 = 1 exactly. The other 63
    channels are the init's ~0.02, so rms(x) ~ sqrt((1 + 63 x 0.02^2) / 64) ~ 0.126 and the final
    norm's output has h_0 ~ 1 / 0.126 ~ 7.9 (norm weight 1), the others ~ 0.16. The embeddings are
    tied: logit_v = h . E[v]. Every row has E[v, 0] = 1, a shift softmax ignores; eos's has 1.5, so
    its logit stands ~ 7.9 x 0.5 ~ 4 above the rest (whose spread is ~ 0.03): p(eos) ~ e^4 / (e^4 + 511)
    ~ 0.1 per token, and about half of 8-token completions end early. Prompts are bytes (< 256), so
    the eos row is only ever read as an output."""
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    params = rlkjax.init_params(cfg, seed=0)
    layers = params["layers"]
    params = {
        **params,
        "embed_tokens": params["embed_tokens"].at[:, 0].set(1.0).at[EOS, 0].set(1.5),
        "layers": {**layers, **{name: layers[name].at[:, 0].set(0) for name in ("o_proj", "down_proj")}},
    }
    rlkjax.save_hf_checkpoint(directory, cfg, params)
    return str(directory)
