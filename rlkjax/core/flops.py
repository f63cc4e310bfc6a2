"""The one FLOPs and MFU definition: every number called MFU in this repository comes from here.

Model FLOPs of a pass over whole sequences (a prefill, a scoring pass, a learner step):

    per real token  = k x matmul parameters          k = 2 forward only, 6 forward + backward
    per sequence    + k x layers x query heads x head dim x n^2
                                                      (the causal attention term, n = real length)

The attention term is MaxText's (`maxtext_utils.calculate_tflops_training_per_device`): per layer
QK^T and PV cost 4 x B x S^2 x query heads x head dim FLOPs without a mask, halved for the causal
mask (`causal_attention_flops = noncausal_attention_flops / 2`), and tripled for training (the
backward is counted as twice the forward). That is 6 x layers x query heads x head dim x S per
trained token, half of the non-causal 12; S^2 / 2 query-key pairs, not S (S + 1) / 2, so the
diagonal is left out as MaxText leaves it out. A decode step of one token whose context holds c
keys (itself included) counts 2 x matmul parameters + 4 x layers x query heads x head dim x c:
summed over a sequence's tokens that is the forward's count above plus n / 2 diagonal pairs.

Matmul parameters are the weights a token is multiplied by: per layer the q, k, v, o projections and
the gate, up and down projections, plus the lm_head (vocab x hidden, tied to the embedding or not:
the lm_head is a matmul either way, the embedding lookup is a gather and counts nothing). Norm
weights count nothing. Only real tokens count: a padded position's work is reported separately
(`FlopCount.padding`), never in MFU.

Hand count, qwen3-0.6b (hidden 1024, 28 layers, 16 query heads, 8 KV heads, head dim 128, FFN 3072,
vocab 151,936), the shape `tests/test_flops.py` checks:
    per layer  q 1024 x 2048 + k, v 2 x 1024 x 1024 + o 2048 x 1024 + gate, up, down 3 x 1024 x 3072
               = 2,097,152 + 2,097,152 + 2,097,152 + 9,437,184 = 15,728,640
    layers     28 x 15,728,640 = 440,401,920   (the model card's "0.44B non-embedding parameters")
    lm_head    151,936 x 1024 = 155,582,464
    matmul parameters = 595,984,384
    one trained sequence of 1,024 tokens:
        6 x 595,984,384 x 1,024      = 3,661,728,055,296
        6 x 28 x 16 x 128 x 1,024^2  =   360,777,252,864
        total                        = 4,022,505,308,160 FLOPs (3.93 GFLOP per token)

LoRA (cfg.lora): the base weights are frozen, so their weight gradient is never computed: a trained token costs
4 x matmul parameters (forward and input gradient) + 6 x adapter parameters (A [r, in] and B [out, r] of every
target, trained) + the same attention term (it has no weights; its backward is all input gradient); a forward pass
2 x (matmul + adapter parameters). Qwen3-8B at rank 16 on all seven projections: per layer 16 x (q 4096 + 4096,
k and v 2 x (4096 + 1024), o 4096 + 4096, gate, up and down 3 x (4096 + 12288)) = 16 x 75,776 = 1,212,416, so
36 x that = 43,646,976 adapter parameters against 7,568,097,280 matmul ones; a trained token counts
4 x 7,568,097,280 + 6 x 43,646,976 = 30,534,270,976 FLOPs before attention, where full-parameter training
counts 45,408,583,680: an MFU computed with 6 x would overstate LoRA's by half.

MFU = model FLOPs / seconds / (devices x peak), with the dense bf16 peak of the device kind below.
Say with every MFU whether it is the learner pass alone or the whole GRPO step (rollout included).
"""

import dataclasses

import numpy as np

from .config import ModelConfig

# Dense (no sparsity) bf16 peak FLOP/s and HBM bandwidth in bytes/s, from the vendors' datasheets,
# keyed by a substring of `jax.Device.device_kind` ("NVIDIA H200", "AMD Instinct MI300X").
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "MI300X": 1307e12, "MI355X": 2500e12}
HBM_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "MI300X": 5.3e12, "MI355X": 8.0e12}

FORWARD = 2  # FLOPs per parameter per token: one multiply-add
TRAINING = 6  # forward + backward (the backward computes two products per forward one)


def matmul_params(cfg: ModelConfig) -> int:
    """Weights a token is multiplied by in one forward pass (see the module docstring)."""
    d, dh = cfg.hidden_size, cfg.head_dim
    attention = d * cfg.num_heads * dh * 2 + d * cfg.num_kv_heads * dh * 2  # q and o; k and v
    mlp = 3 * d * cfg.intermediate_size  # gate, up, down
    return cfg.num_layers * (attention + mlp) + cfg.vocab_size * d


def adapter_params(cfg: ModelConfig) -> int:
    """LoRA's trained parameters, r x (in + out) per target per layer; 0 without LoRA."""
    if cfg.lora is None:
        return 0
    d, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    sides = {"q_proj": d + q, "k_proj": d + kv, "v_proj": d + kv, "o_proj": q + d}
    sides |= {"gate_proj": d + f, "up_proj": d + f, "down_proj": f + d}
    return cfg.num_layers * cfg.lora.rank * sum(sides[t] for t in cfg.lora.targets)


def matmul_flops_per_token(cfg: ModelConfig, backward: bool) -> int:
    """The weights' FLOPs per token: 2 (forward) or 6 (training) x matmul parameters; with LoRA the frozen base
    costs 4 in training (no weight gradient) and the adapters 6 (see the module docstring)."""
    adapters = adapter_params(cfg)
    if not backward:
        return FORWARD * (matmul_params(cfg) + adapters)
    if cfg.lora is None:
        return TRAINING * matmul_params(cfg)
    return (TRAINING - FORWARD) * matmul_params(cfg) + TRAINING * adapters


def attention_flops_per_token(cfg: ModelConfig, length: int, per_param: int = TRAINING) -> int:
    """The causal attention term per token of a sequence of `length` real tokens (MaxText's)."""
    return per_param * cfg.num_layers * cfg.num_heads * cfg.head_dim * length


@dataclasses.dataclass(frozen=True)
class FlopCount:
    model: float  # FLOPs of the real tokens: what MFU counts
    padding: float  # what the padded positions cost on top, if the kernels run them (not in MFU)
    tokens: int  # real tokens
    padded_tokens: int  # positions run that hold no token


def sequence_flops(cfg: ModelConfig, lengths, padded_length: int | None = None, *, backward: bool) -> FlopCount:
    """FLOPs of one pass over whole sequences of the given real lengths (a prefill or scoring pass with
    `backward=False`, a learner forward + backward with `backward=True`). `padded_length`: the length
    every row was padded to, for the padding report (None: no padding)."""
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    if (lengths < 0).any():
        raise ValueError(f"lengths={lengths.tolist()} must be non-negative")
    if padded_length is not None and (lengths > padded_length).any():
        raise ValueError(f"padded_length={padded_length} is shorter than a sequence ({lengths.max()})")
    per_param = TRAINING if backward else FORWARD

    def count(n: np.ndarray) -> float:
        per_seq = matmul_flops_per_token(cfg, backward) * n + attention_flops_per_token(cfg, 1, per_param) * n * n
        return float(per_seq.sum())

    model = count(lengths)
    if padded_length is None:
        return FlopCount(model, 0.0, int(lengths.sum()), 0)
    padded = np.full_like(lengths, padded_length)
    return FlopCount(model, count(padded) - model, int(lengths.sum()), int((padded - lengths).sum()))


def decode_flops(cfg: ModelConfig, context_lengths) -> float:
    """FLOPs of one decode step (forward only) over rows whose contexts hold these many keys, the
    new token included: 2 x matmul (and adapter) parameters + 4 x layers x query heads x head dim x context per row."""
    context = np.asarray(context_lengths, np.int64).reshape(-1)
    per_key = 2 * FORWARD * cfg.num_layers * cfg.num_heads * cfg.head_dim  # QK^T and PV
    return float((matmul_flops_per_token(cfg, backward=False) + per_key * context).sum())


def _lookup(table: dict[str, float], device) -> float | None:
    kind = device if isinstance(device, str) else device.device_kind
    return next((value for name, value in table.items() if name in kind), None)


def peak_flops(device) -> float | None:
    """Dense bf16 peak FLOP/s of a `jax.Device` or device-kind string; None where unknown (CPU)."""
    return _lookup(PEAK_BF16_FLOPS, device)


def hbm_bandwidth(device) -> float | None:
    """HBM bandwidth in bytes/s of a `jax.Device` or device-kind string; None where unknown (CPU)."""
    return _lookup(HBM_BANDWIDTH, device)


def mfu(flops: float, seconds: float, device, devices: int = 1) -> float | None:
    """Model FLOPs utilisation: `flops` (a `FlopCount.model`) done in `seconds` by `devices` devices of
    `device`'s kind, over their dense bf16 peak. None where the peak is unknown (CPU)."""
    peak = peak_flops(device)
    if peak is None:
        return None
    if seconds <= 0 or devices <= 0:
        raise ValueError(f"seconds={seconds} and devices={devices} must be positive")
    return flops / seconds / (devices * peak)
