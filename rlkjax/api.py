"""`generate` (through the rollout engine) and `score` (the learner's pass over finished
sequences). Inputs are checked by rlkjax.requests, the one place every entry point uses. Shapes are
padded to power-of-two buckets so a long run compiles a handful of functions, and padding never
changes a real row's bits (see pallas_kernels).
"""

import jax
import numpy as np

from rlkjax.config import ModelConfig
from rlkjax.engine import Completion, Engine, EngineConfig
from rlkjax.model import rope_tables, sequence_logprobs
from rlkjax.numerics import PAGE_SIZE, Numerics, ops
from rlkjax.requests import check_batch, check_int, check_seed, check_temperature, per_row
from rlkjax.shapes import bucket, pad_sequences


def generate(
    params,
    cfg: ModelConfig,
    prompts,
    max_new_tokens: int = 32,
    temperature=1.0,
    seeds=0,
    numerics: Numerics = "strict",
    prefill_chunk_size: int = 64,
) -> list[Completion]:
    """Sample `max_new_tokens` tokens after each prompt, recording each token's logprob.

    temperature and seeds: one per prompt, or a scalar for all. A request's tokens depend on its
    prompt, seed and temperature only, not on the batch it ran in. A thin wrapper over the rollout
    engine, sized so nothing is preempted: there is one generation path.
    """
    ops(numerics)  # validates the mode (and the strict XLA flags) before any work
    prompts = check_batch("prompts", prompts, cfg.vocab_size)
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    prefill_chunk_size = check_int("prefill_chunk_size", prefill_chunk_size, 1)
    temps = [check_temperature("temperature", t) for t in per_row("temperature", temperature, len(prompts))]
    seeds = [check_seed("seeds", s) for s in per_row("seeds", seeds, len(prompts))]
    lengths = [len(p) + max_new_tokens for p in prompts]
    if max(lengths) > cfg.max_position:
        raise ValueError(
            f"prompt + max_new_tokens = {max(lengths)} tokens exceeds the model's context of {cfg.max_position}"
        )
    engine = Engine(params, cfg, numerics, EngineConfig.for_batch(lengths, prefill_chunk_size))
    requests = [
        engine.submit(p, max_new_tokens=max_new_tokens, temperature=t, seed=s) for p, t, s in zip(prompts, temps, seeds)
    ]
    engine.run_until_done()
    return [r.results[0] for r in requests]


_sequence_logprobs = jax.jit(sequence_logprobs, static_argnames=("cfg", "numerics"))


def score(
    params, cfg: ModelConfig, sequences, prompt_lens, temperature=1.0, numerics: Numerics = "strict"
) -> list[np.ndarray]:
    """Log-probs of sequences[i][prompt_lens[i]:] given their prefixes: the learner's computation."""
    ops(numerics)
    sequences = check_batch("sequences", sequences, cfg.vocab_size)
    n = len(sequences)
    plens = [
        check_int(f"prompt_lens[{i}]", p, 1, len(s))
        for i, (s, p) in enumerate(zip(sequences, per_row("prompt_lens", prompt_lens, n)))
    ]
    for i, s in enumerate(sequences):
        if len(s) > cfg.max_position:
            raise ValueError(f"sequences[{i}] has {len(s)} tokens, over the model's context of {cfg.max_position}")
    temps = np.asarray(
        [check_temperature("temperature", t) for t in per_row("temperature", temperature, n)], np.float32
    )
    b, t = bucket(n), bucket(max(len(s) for s in sequences), minimum=PAGE_SIZE)
    tokens, positions = pad_sequences(sequences, b, t)
    temps = np.pad(temps, (0, b - n), constant_values=1.0)
    logp = np.asarray(_sequence_logprobs(params, tokens, positions, temps, rope_tables(cfg), cfg, numerics))
    return [logp[i, p - 1 : len(s) - 1].copy() for i, (s, p) in enumerate(zip(sequences, plens))]
