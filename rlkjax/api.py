"""`generate` (through the rollout engine) and `score` (the learner's pass over finished
sequences), with input validation. Shapes are padded to power-of-two buckets so a long run
compiles a handful of functions, and padding never changes a real row's bits (see pallas_kernels).
"""
import dataclasses
import math

import jax
import numpy as np

from rlkjax.config import ModelConfig
from rlkjax.model import rope_tables, sequence_logprobs
from rlkjax.numerics import PAGE_SIZE, Numerics, ops


@dataclasses.dataclass
class Completion:
    tokens: list[int]
    logprobs: np.ndarray  # float32, one per token: log p(token | prefix) at the sampling temperature
    finish_reason: str = "length"  # "length" | "stop" | "cancelled"
    policy_version: int = 0


def _bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def _per_row(name, value, n, cast):
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * n
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} sequences")
    return [cast(v) for v in values]


def _check_temperatures(temperature, n) -> np.ndarray:
    temps = np.asarray(_per_row("temperature", temperature, n, float), np.float32)
    bad = [t for t in temps if not (math.isfinite(t) and t > 0)]
    if bad:
        raise ValueError(f"temperature must be finite and > 0, got {bad[0]}")
    return temps


def _check_tokens(name, seqs, cfg: ModelConfig) -> list[list[int]]:
    if not isinstance(seqs, (list, tuple)) or not seqs:
        raise ValueError(f"{name} must be a non-empty list of token-id lists")
    out = []
    for i, s in enumerate(seqs):
        arr = np.asarray(s)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"{name}[{i}] must be a non-empty 1-D list of token ids, got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name}[{i}] must hold integer token ids, got dtype {arr.dtype}")
        bad = arr[(arr < 0) | (arr >= cfg.vocab_size)]
        if bad.size:
            raise ValueError(f"{name}[{i}] has token id {int(bad[0])} outside [0, {cfg.vocab_size})")
        out.append([int(t) for t in arr])
    return out


def _check_seeds(seeds, n) -> np.ndarray:
    values = _per_row("seeds", seeds, n, lambda s: s)
    for s in values:
        if not isinstance(s, (int, np.integer)) or not 0 <= s < 2**32:
            raise ValueError(f"seeds must be integers in [0, 2**32), got {s!r}")
    return np.asarray(values, np.uint32)


def generate(params, cfg: ModelConfig, prompts, max_new_tokens: int = 32, temperature=1.0, seeds=0,
             numerics: Numerics = "strict", prefill_chunk_size: int = 64) -> list[Completion]:
    """Sample `max_new_tokens` tokens after each prompt, recording each token's logprob.

    temperature and seeds: one per prompt, or a scalar for all. A request's tokens depend on its
    prompt, seed and temperature only, not on the batch it ran in. A thin wrapper over the rollout
    engine (serve.engine), sized so nothing is preempted: there is one generation path.
    """
    from serve.engine import Engine, EngineConfig  # the engine builds on this module

    ops(numerics)  # validates the mode (and the strict XLA flags) before any work
    prompts = _check_tokens("prompts", prompts, cfg)
    n = len(prompts)
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not isinstance(prefill_chunk_size, int) or prefill_chunk_size <= 0:
        raise ValueError(f"prefill_chunk_size must be a positive int, got {prefill_chunk_size!r}")
    temps, seed_arr = _check_temperatures(temperature, n), _check_seeds(seeds, n)
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > cfg.max_position:
        raise ValueError(f"prompt + max_new_tokens = {longest} tokens exceeds the model's context of {cfg.max_position}")
    pages = sum(-(-(len(p) + max_new_tokens) // PAGE_SIZE) for p in prompts)
    rows = _bucket(n)
    engine = Engine(params, cfg, numerics, EngineConfig(
        num_pages=1 + pages, max_batch=rows, prefill_chunk=prefill_chunk_size,
        token_budget=prefill_chunk_size * rows, max_context=min(_bucket(longest, PAGE_SIZE), cfg.max_position)))
    requests = [engine.submit(p, max_new_tokens=max_new_tokens, temperature=float(t), seed=int(s))
                for p, t, s in zip(prompts, temps, seed_arr)]
    engine.run_until_done()
    return [r.results[0] for r in requests]


_sequence_logprobs = jax.jit(sequence_logprobs, static_argnames=("cfg", "numerics"))


def score(params, cfg: ModelConfig, sequences, prompt_lens, temperature=1.0, numerics: Numerics = "strict") -> list[np.ndarray]:
    """Log-probs of sequences[i][prompt_lens[i]:] given their prefixes: the learner's computation."""
    ops(numerics)
    sequences = _check_tokens("sequences", sequences, cfg)
    n = len(sequences)
    plens = _per_row("prompt_lens", prompt_lens, n, int)
    for i, (s, p) in enumerate(zip(sequences, plens)):
        if not 1 <= p <= len(s):
            raise ValueError(f"prompt_lens[{i}]={p} must be in [1, {len(s)}] (the sequence length)")
        if len(s) > cfg.max_position:
            raise ValueError(f"sequences[{i}] has {len(s)} tokens, over the model's context of {cfg.max_position}")
    temps = _check_temperatures(temperature, n)
    b, t = _bucket(n), _bucket(max(len(s) for s in sequences), minimum=PAGE_SIZE)
    tokens = np.zeros((b, t), np.int32)
    positions = np.full((b, t), -1, np.int32)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = s
        positions[i, : len(s)] = np.arange(len(s))
    temps = np.pad(temps, (0, b - n), constant_values=1.0)
    logp = np.asarray(_sequence_logprobs(params, tokens, positions, temps, rope_tables(cfg), cfg, numerics))
    return [logp[i, p - 1 : len(s) - 1].copy() for i, (s, p) in enumerate(zip(sequences, plens))]
