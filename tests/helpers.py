"""What several test files share: exact bit comparisons and the odd model shape every kernel pads.
(Fixtures and pytest's hooks live in conftest.py, which test files do not import.)"""

import numpy as np

import rlkjax


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
