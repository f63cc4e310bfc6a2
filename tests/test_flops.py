"""The one FLOPs and MFU definition against the hand count in rlkjax/core/flops.py's docstring."""

import dataclasses

import numpy as np
import pytest

import rlkjax
from rlkjax.core import flops, lora, model
from rlkjax.core.config import LoraConfig

QWEN3_06B = rlkjax.ModelConfig.preset("qwen3-0.6b")


def test_matmul_params_hand_count_and_model_shapes():
    """The hand count of qwen3-0.6b, and the same number from the model's own weight shapes (a layer
    weight added to the model without being counted here would break the second equality)."""
    assert flops.matmul_params(QWEN3_06B) == 28 * 15_728_640 + 151_936 * 1024 == 595_984_384
    for cfg in (QWEN3_06B, rlkjax.ModelConfig.preset("qwen3-8b"), rlkjax.ModelConfig.preset("qwen3-tiny")):
        per_layer = sum(int(np.prod(s)) for n, s in model.layer_shapes(cfg).items() if n in model.MATRICES)
        assert flops.matmul_params(cfg) == cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size


def test_training_flops_hand_count():
    """One trained 1,024-token sequence of qwen3-0.6b: 6 x params x tokens + 6 x L x Hq x Dh x n^2."""
    count = flops.sequence_flops(QWEN3_06B, [1024], backward=True)
    assert count.model == 3_661_728_055_296 + 360_777_252_864 == 4_022_505_308_160
    assert (count.tokens, count.padding, count.padded_tokens) == (1024, 0.0, 0)
    # The forward alone is a third of it.
    assert flops.sequence_flops(QWEN3_06B, [1024], backward=False).model * 3 == count.model


def test_padding_reported_separately():
    """Rows of 1,000 and 24 real tokens padded to 1,024: MFU counts the real tokens only; the padding
    costs what the two padded rows would minus that."""
    count = flops.sequence_flops(QWEN3_06B, [1000, 24], padded_length=1024, backward=True)
    real = sum(flops.sequence_flops(QWEN3_06B, [n], backward=True).model for n in (1000, 24))
    assert count.model == real
    assert count.model + count.padding == 2 * 4_022_505_308_160
    assert (count.tokens, count.padded_tokens) == (1024, 1024)
    with pytest.raises(ValueError, match="padded_length"):
        flops.sequence_flops(QWEN3_06B, [1025], padded_length=1024, backward=True)


def test_decode_steps_sum_to_the_forward():
    """Decoding a sequence token by token counts the forward's FLOPs plus the half of the diagonal that
    the causal convention's n^2 / 2 pairs leave out of n (n + 1) / 2: n / 2 pairs of 4 x L x Hq x Dh."""
    n = 37
    steps = sum(flops.decode_flops(QWEN3_06B, [c]) for c in range(1, n + 1))
    forward = flops.sequence_flops(QWEN3_06B, [n], backward=False).model
    assert steps - forward == 2 * 28 * 16 * 128 * n


def test_peaks_and_mfu():
    assert flops.peak_flops("NVIDIA H200") == flops.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert flops.peak_flops("AMD Instinct MI300X") == 1307e12
    assert flops.peak_flops("AMD Instinct MI355X") == 2500e12
    assert flops.hbm_bandwidth("NVIDIA H200") == 4.8e12
    assert flops.hbm_bandwidth("AMD Instinct MI300X") == 5.3e12
    assert flops.peak_flops("cpu") is None and flops.mfu(1e12, 1.0, "cpu") is None
    # 4.02 TFLOP in 10 ms on two H200s: 4.0225e14 FLOP/s over 2 x 989e12.
    assert flops.mfu(4_022_505_308_160, 0.01, "NVIDIA H200", devices=2) == pytest.approx(0.20336, abs=1e-5)


def test_lora_flops_hand_count():
    """Qwen3-8B with rank-16 adapters on all seven projections (flops.py's docstring): 43,646,976 adapter
    parameters, counted from the adapters' own shapes too; a trained token costs 4 x the frozen base (forward and
    input gradient, no weight gradient) + 6 x the adapters; a forward 2 x both; attention unchanged."""
    base = rlkjax.ModelConfig.preset("qwen3-8b")
    cfg = dataclasses.replace(base, lora=LoraConfig(rank=16))
    assert flops.matmul_params(cfg) == 7_568_097_280
    assert flops.adapter_params(cfg) == 36 * 16 * 75_776 == 43_646_976
    assert flops.adapter_params(cfg) == sum(int(np.prod(s)) for s in lora.adapter_shapes(cfg).values())
    n = 1024
    attention = 6 * 36 * 32 * 128 * n * n
    trained = flops.sequence_flops(cfg, [n], backward=True).model
    assert trained == (4 * 7_568_097_280 + 6 * 43_646_976) * n + attention == 30_534_270_976 * n + attention
    assert flops.sequence_flops(base, [n], backward=True).model == 45_408_583_680 * n + attention
    forward = flops.sequence_flops(cfg, [n], backward=False).model
    assert forward == 2 * (7_568_097_280 + 43_646_976) * n + attention // 3
    assert flops.decode_flops(cfg, [1]) == 2 * (7_568_097_280 + 43_646_976) + 4 * 36 * 32 * 128
    only_qv = dataclasses.replace(base, lora=LoraConfig(rank=8, targets=("q_proj", "v_proj")))
    assert flops.adapter_params(only_qv) == 36 * 8 * ((4096 + 4096) + (4096 + 1024))
