import os

import numpy as np
import pytest

import rlkjax  # noqa: F401  (sets the strict XLA flags before any test starts a backend)


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


@pytest.fixture(scope="session")
def tiny():
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    return cfg, rlkjax.init_params(cfg, seed=0)


def pytest_report_header(config):
    import jax

    return f"jax {jax.__version__}, backend {jax.default_backend()}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
