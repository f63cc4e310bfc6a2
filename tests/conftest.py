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


@pytest.fixture(scope="session")
def tiny():
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    return cfg, rlkjax.init_params(cfg, seed=0)


def pytest_report_header(config):
    import jax

    return f"jax {jax.__version__}, backend {jax.default_backend()}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
