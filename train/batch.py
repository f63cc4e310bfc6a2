"""The learner's data, typed: the batch it trains on (`Batch`, built by `pack`) and the statistics its
loss reports (`LossStats`, each with a declared reduction). Both are NamedTuples, so they are pytrees:
`train/fsdp.py` shards a `Batch` by rows and merges `LossStats` across devices from these declarations,
with no list of field names of its own.
"""

from typing import NamedTuple

import jax
import numpy as np

from rlkjax.core.numerics import PAGE_SIZE
from rlkjax.core.shapes import bucket, cdiv, pad_sequences


class Batch(NamedTuple):
    """B sequences (prompt + completion) padded to T tokens. Every field has rows first, so the FSDP
    learner splits each of them by rows. Logprob column t is log p(token t + 1 | tokens <= t)."""

    tokens: np.ndarray  # [B, T] int32
    positions: np.ndarray  # [B, T] int32; -1 on padding (written to the trash page, never attended)
    logp_old: np.ndarray  # [B, T-1] f32: the sampler's recorded logprob on sampled tokens, 0 elsewhere
    # [B, T-1] f32: 1 on sampled tokens (the ones trained: a completion's, or every turn's of an episode), 0 on
    # prompts, tokens an environment or chat template added between turns, and padding
    mask: np.ndarray
    adv: np.ndarray  # [B] f32: the sequence's advantage
    temps: np.ndarray  # [B] f32: the sampling temperature the learner scores at
    tis: np.ndarray  # [B, T-1] f32: truncated importance weight (1 = none; only --numerics fast sets it)
    # [B, C] int32: the logprob columns the loss reads (the completion's; -1 pads a row's list), so the
    # learner takes the log-softmax there only (model.completion_logprobs); None scores every column.
    columns: np.ndarray | None = None


# What an all-padding row holds. Positions -1 keep it out of attention; temperature 1 because the
# logprob kernel divides by it; everything else 0, so with mask 0 the row adds nothing to the loss.
PAD = Batch(tokens=0, positions=-1, logp_old=0.0, mask=0.0, adv=0.0, temps=1.0, tis=0.0, columns=-1)


LENGTH_STEP = 32


def padded_length(n: int) -> int:
    """T for sequences of up to n tokens: a power of two up to 128 (at least a page), then the next
    multiple of LENGTH_STEP, so a run compiles a handful of shapes while padding costs at most 31 tokens
    a row (the learner's work on padding is MFU lost:
    bench/results/2026-12-03_h200_cpu_measurements_behind_defaults.md). A token's logprob bits do not depend on T."""
    return bucket(n, PAGE_SIZE) if n <= 128 else cdiv(n, LENGTH_STEP) * LENGTH_STEP


def pack(samples) -> Batch:
    """Samples (dicts with prompt, tokens, logprobs, adv, temperature, and optionally mask) -> a Batch of T =
    padded_length(the longest sequence) tokens and C = the most sampled tokens of a row, as a power of two (a
    handful of shapes; a page's minimum, as T has, made short completions' head work twice or more).
    mask: per token of `tokens`, 1 where it was sampled (trained, logprobs the sampler's) and 0 where an
    environment or chat template added it (an episode's tool results and turn wrappers: conditioned on, never
    trained, never scored); absent, every token of `tokens` was sampled."""
    sequences = [s["prompt"] + s["tokens"] for s in samples]
    sampled = [np.flatnonzero(s["mask"]) if "mask" in s else np.arange(len(s["tokens"])) for s in samples]
    rows, length = len(samples), padded_length(max(map(len, sequences)))
    tokens, positions = pad_sequences(sequences, rows, length)
    logp_old, mask = np.zeros((rows, length - 1), np.float32), np.zeros((rows, length - 1), np.float32)
    columns = np.full((rows, bucket(max(map(len, sampled)))), -1, np.int32)
    for i, (s, which) in enumerate(zip(samples, sampled)):
        cols = len(s["prompt"]) - 1 + which  # column t predicts token t + 1
        logp_old[i, cols] = np.asarray(s["logprobs"], np.float32)[which]
        mask[i, cols] = 1
        columns[i, : len(cols)] = cols
    return Batch(
        tokens=tokens,
        positions=positions,
        logp_old=logp_old,
        mask=mask,
        adv=np.array([s["adv"] for s in samples], np.float32),
        temps=np.array([s["temperature"] for s in samples], np.float32),
        tis=np.ones((rows, length - 1), np.float32),
        columns=columns,
    )


def pad_rows(batch: Batch, multiple: int) -> Batch:
    """Append all-padding rows (the values in PAD) until the row count is a multiple of `multiple`."""
    extra = -len(batch.tokens) % multiple
    if not extra:
        return batch
    return jax.tree.map(lambda v, fill: np.concatenate([v, np.full((extra, *v.shape[1:]), fill, v.dtype)]), batch, PAD)


def micro_length(n: int, whole: int) -> int:
    """T of a micro-batch whose longest sequence has n tokens, in a batch padded to `whole`: padded_length's
    powers of two up to 128, then 8 lengths an octave (multiples of 32, at most 1/8 of padding), never past
    `whole` (a run whose sequences all reach --max-new-tokens compiles one length, the batch's own). A few
    shapes over a whole run, whatever its completions' lengths; a token's logprob bits do not depend on T."""
    if n <= 128:
        return min(padded_length(n), whole)
    step = max(LENGTH_STEP, 1 << max(0, (n - 1).bit_length() - 4))
    return min(cdiv(n, step) * step, whole)


class MicroBatch(NamedTuple):
    """Which rows of a Batch one micro-batch holds, and its shape: `size` rows (the rows, then padding rows)
    of `length` tokens and `width` scored columns."""

    rows: np.ndarray  # [n] int: indices into the Batch, longest first
    size: int  # rows with padding: a multiple of the devices
    length: int  # T
    width: int  # C


def plan_micro_batches(batch: Batch, budget: int, devices: int = 1) -> list[MicroBatch]:
    """The batch's rows in micro-batches of at most `budget` padded tokens per device: rows sorted by length,
    longest first, each micro-batch as many rows of its longest row's micro_length as the budget allows on
    every device (one row a device when that row alone is longer than the budget: a long row still runs).
    A micro-batch of a length holds that many rows a device, or (the last of its length) a power of two fewer,
    so a run compiles a few shapes."""
    if budget <= 0:
        raise ValueError(f"a micro-batch token budget of {budget} holds nothing; it must be positive")
    lengths = (batch.positions >= 0).sum(axis=1)
    scored = (batch.columns >= 0).sum(axis=1) if batch.columns is not None else lengths
    order = np.argsort(-lengths, kind="stable")
    whole = batch.tokens.shape[1]
    plan, start = [], 0
    while start < len(order):
        length = micro_length(int(lengths[order[start]]), whole)
        per_device = max(1, budget // length)
        rows = order[start : start + per_device * devices]
        size = min(bucket(cdiv(len(rows), devices)), per_device) * devices
        width = bucket(int(scored[rows].max())) if batch.columns is not None else 0
        plan.append(MicroBatch(rows, size, length, width))
        start += len(rows)
    return plan


def micro_batch(batch: Batch, mb: MicroBatch) -> Batch:
    """The rows `mb` names, cut to its length and columns and padded with empty rows to its size."""
    per_token = mb.length - 1  # logprob columns

    def cut(name, values):
        if values is None or values.ndim == 1:
            return None if values is None else values[mb.rows]
        width = {"tokens": mb.length, "positions": mb.length, "columns": mb.width}.get(name, per_token)
        return values[mb.rows, :width]

    return pad_rows(Batch(*(cut(name, values) for name, values in zip(Batch._fields, batch))), mb.size)


def micro_batches(batch: Batch, budget: int, devices: int = 1):
    """(MicroBatch, its Batch) for each micro-batch of plan_micro_batches."""
    for mb in plan_micro_batches(batch, budget, devices):
        yield mb, micro_batch(batch, mb)


def unpermute(parts, plan: list[MicroBatch], rows: int, columns: int) -> np.ndarray:
    """Per-micro-batch [size, length - 1] arrays (logprobs, host) -> [rows, columns] in the batch's row order,
    zeros past each micro-batch's length (padding, never scored)."""
    out = np.zeros((rows, columns), np.float32)
    for mb, part in zip(plan, parts):
        out[mb.rows, : mb.length - 1] = np.asarray(part)[: len(mb.rows)]
    return out


class LossStats(NamedTuple):
    """What the loss reports about one micro-batch (scalars), besides the loss itself. REDUCTION
    declares how each field combines across devices and micro-batches."""

    ratio_min: jax.Array  # min of rho = exp(logp_new - logp_old) over completion tokens
    ratio_max: jax.Array  # max of rho
    ratio_sum: jax.Array  # sum of rho (ratio mean = ratio_sum / tokens)
    clipped: jax.Array  # tokens whose rho left [1 - eps, 1 + eps]


REDUCTION = LossStats(ratio_min="min", ratio_max="max", ratio_sum="sum", clipped="sum")


def reduce_stats(stats: list[LossStats]) -> LossStats:
    """Combine micro-batches' stats (on the host) by each field's declared reduction."""
    host = {"min": np.min, "max": np.max, "sum": np.sum}
    return LossStats(*(host[how](np.stack(values)) for how, values in zip(REDUCTION, zip(*stats))))
