"""`generate` (through the rollout engine) and `score` (the learner's pass over finished
sequences). Inputs are checked by rlkjax.core.checks, the one place every entry point uses. Shapes are
padded to power-of-two buckets so a long run compiles a handful of functions, and padding never
changes a real row's bits (see pallas_kernels).
"""

import dataclasses

import jax
import numpy as np

from rlkjax.core.checks import (
    check_batch,
    check_bool,
    check_fraction,
    check_int,
    check_seed,
    check_temperature,
    most_top_logprobs,
    per_row,
)
from rlkjax.core.config import ModelConfig
from rlkjax.core.model import LearnerPass, Sequences, rope_tables, sequence_logprobs
from rlkjax.core.numerics import PAGE_SIZE, Numerics, ops
from rlkjax.core.sampling_params import SamplingParams
from rlkjax.core.shapes import bucket, pad_sequences
from rlkjax.engine import outputs
from rlkjax.engine.config import EngineConfig
from rlkjax.engine.engine import Engine
from rlkjax.engine.records import Completion


def generate(
    params,
    cfg: ModelConfig,
    prompts,
    max_tokens: int | None = None,
    temperature=None,
    seeds=None,
    numerics: Numerics = "strict",
    prefill_chunk_size: int = 64,
    *,
    sampling: SamplingParams | list[SamplingParams] | None = None,
    eos_token_id: int | None = None,
    max_new_tokens: int | None = None,
) -> list[Completion]:
    """Sample completions of each prompt, recording each token's logprob.

    `sampling`: one SamplingParams for every prompt or a list of one per prompt (default:
    SamplingParams(max_tokens=32)). The shortcuts override its fields: max_tokens (also accepted
    as max_new_tokens), temperature, and seeds (a scalar for all prompts, or one per prompt) its
    seed. Returns the completions in prompt order, the n samples of prompt i at
    i * n ... i * n + n - 1. A request's tokens depend on its prompt, seed and temperature only, not
    on the batch it ran in. eos_token_id: a sampled eos ends a completion (and belongs to it) unless
    ignore_eos. With prompt_logprobs=k a completion also carries its prompt's logprobs (prompt[1:],
    by `score`, the learner's pass) and, for k > 0, their k top logprobs. A thin wrapper over the
    rollout engine, sized so nothing is preempted: there is one generation path.
    """
    ops(numerics)  # validates the mode (and the strict XLA flags) before any work
    prompts = check_batch("prompts", prompts, cfg.vocab_size)
    if max_new_tokens is not None:
        if max_tokens is not None:
            raise ValueError("give max_tokens or max_new_tokens (its earlier name), not both")
        max_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    rows = _row_sampling(sampling, len(prompts), max_tokens, temperature, seeds)
    prefill_chunk_size = check_int("prefill_chunk_size", prefill_chunk_size, 1)
    for prompt, row in zip(prompts, rows):  # before any device work
        row.check_model(cfg.vocab_size, cfg.max_position, len(prompt))
    lengths = [len(p) + row.max_tokens for p, row in zip(prompts, rows) for _ in range(row.n)]
    sizing = EngineConfig.for_batch(lengths, prefill_chunk_size)
    # The KV cache is an argument of every program: an exact page count compiled them all again
    # for each new set of prompt lengths. A power-of-two bucket (at most twice the pages) keeps a run
    # of calls to a handful of programs. Training's rollout engine is built once and keeps its exact size.
    sizing = dataclasses.replace(sizing, num_pages=bucket(sizing.num_pages))
    engine = Engine(params, cfg, numerics, sizing, eos_token_id)
    requests = [engine.submit(p, row) for p, row in zip(prompts, rows)]
    engine.run_until_done()
    results = [outputs.results(r) for r in requests]  # each request's end, off its output queue
    _add_prompt_logprobs(params, cfg, prompts, rows, results, numerics)
    return [c for row in results for c in row]


def _row_sampling(sampling, n: int, max_tokens, temperature, seeds) -> list[SamplingParams]:
    """One SamplingParams per prompt: `sampling` (broadcast if one) with the shortcuts applied."""
    rows = per_row("sampling", SamplingParams(max_tokens=32) if sampling is None else sampling, n)
    if not all(isinstance(row, SamplingParams) for row in rows):
        raise ValueError("sampling must be a SamplingParams or a list of one per prompt")
    # checked under the names the caller used, before they become fields
    shortcuts = {
        "max_tokens": None if max_tokens is None else [check_int("max_tokens", max_tokens, 1)] * n,
        "temperature": None
        if temperature is None
        else [check_temperature("temperature", t, greedy=True) for t in per_row("temperature", temperature, n)],
        "seed": None if seeds is None else [check_seed("seeds", s) for s in per_row("seeds", seeds, n)],
    }
    for field, values in shortcuts.items():
        if values is not None:
            rows = [dataclasses.replace(row, **{field: v}) for row, v in zip(rows, values)]
    return rows


def _add_prompt_logprobs(params, cfg, prompts, rows: list[SamplingParams], results, numerics):
    """Prompt logprobs, where a row asks for them, from the learner's pass over the prompts alone
    (the completion cannot change them: attention is causal), at each row's temperature; one
    `score` call per number of top logprobs asked for."""
    for k in {row.prompt_logprobs for row in rows} - {None}:
        picked = [i for i, row in enumerate(rows) if row.prompt_logprobs == k]
        temps = [rows[i].temperature for i in picked]
        scored = score(params, cfg, [prompts[i] for i in picked], 1, temps, numerics, top_logprobs=k)
        for i, row in zip(picked, scored):
            for comp in results[i]:
                if k:
                    comp.prompt_logprobs, comp.prompt_top_ids, comp.prompt_top_logprobs = row
                else:
                    comp.prompt_logprobs = row


_sequence_logprobs = jax.jit(sequence_logprobs, static_argnames=("setting",))


def score(
    params,
    cfg: ModelConfig,
    sequences,
    prompt_lens,
    temperature=1.0,
    numerics: Numerics = "strict",
    top_logprobs: int = 0,
    *,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    truncated_logprobs: bool = False,
) -> list:
    """Log-probs of sequences[i][prompt_lens[i]:] given their prefixes: the learner's computation.

    Temperature 0 scores greedy samples: the temperature-1 distribution. With top_logprobs=k > 0,
    row i is a tuple (logprobs [L], top_ids [L, k], top_logprobs [L, k]): the same logprob bits
    plus the k most likely ids at each position (a prompt_lens of 1 gives every prompt token's
    logprob after the first: what `echo` / `prompt_logprobs` return).

    truncated_logprobs=True with top_k / top_p / min_p (scalars or one per row; 0 / 1 / 0: off):
    the logprobs under the truncated, renormalised distribution (-inf for a token outside the kept
    set), the bits the sampler records with truncated_logprobs. Without it the truncation settings
    do not matter: the full distribution's logprob is the same however the token was drawn."""
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
        [check_temperature("temperature", t, greedy=True) for t in per_row("temperature", temperature, n)], np.float32
    )
    most = most_top_logprobs(cfg.vocab_size)
    k = check_int("top_logprobs", top_logprobs, 0, most)
    if check_bool("truncated_logprobs", truncated_logprobs) and k:
        raise ValueError("truncated_logprobs cannot be combined with top_logprobs (top logprobs are full-distribution)")
    if truncated_logprobs:
        truncation = _truncation(cfg, n, top_k, top_p, min_p)
    b, t = bucket(n), bucket(max(len(s) for s in sequences), minimum=PAGE_SIZE)
    tokens, positions = pad_sequences(sequences, b, t)
    temps = np.pad(temps, (0, b - n), constant_values=1.0)
    rows = [slice(p - 1, len(s) - 1) for s, p in zip(sequences, plens)]
    seqs, rope = Sequences(tokens, positions, temps), rope_tables(cfg)
    if truncated_logprobs:
        truncation = tuple(np.pad(a, (0, b - n), mode="edge") for a in truncation)
        outs = _sequence_logprobs(params, seqs._replace(truncation=truncation), rope, LearnerPass(cfg, numerics))
        logp = np.asarray(outs.renormalised)
        return [logp[i, r].copy() for i, r in enumerate(rows)]
    if k == 0:
        logp = np.asarray(_sequence_logprobs(params, seqs, rope, LearnerPass(cfg, numerics)))
        return [logp[i, r].copy() for i, r in enumerate(rows)]
    # one program for every k, as the engine's rounds: `most` top logprobs, the first k kept
    outs = _sequence_logprobs(params, seqs, rope, LearnerPass(cfg, numerics, top_logprobs=most))
    logp, ids, top = (np.asarray(o) for o in (outs.logprobs, outs.top_ids, outs.top_logprobs))
    return [(logp[i, r].copy(), ids[i, r, :k].copy(), top[i, r, :k].copy()) for i, r in enumerate(rows)]


def _truncation(cfg: ModelConfig, n: int, top_k, top_p, min_p):
    """Per-row truncation arrays as the kernels take them (top_k 0 -> the vocabulary: off)."""
    top_k = [min(check_int("top_k", k, 0), cfg.vocab_size) or cfg.vocab_size for k in per_row("top_k", top_k, n)]
    top_p = [check_fraction("top_p", p, 0.0, 1.0, lo_open=True) for p in per_row("top_p", top_p, n)]
    min_p = [check_fraction("min_p", p, 0.0, 1.0) for p in per_row("min_p", min_p, n)]
    return np.asarray(top_k, np.int32), np.asarray(top_p, np.float32), np.asarray(min_p, np.float32)
