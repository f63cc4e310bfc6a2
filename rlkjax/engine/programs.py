"""The rollout engine's jitted device functions: prefill a chunk, one decode step, a decode round
(several steps in one device loop), the round that continues the one in flight, and the page copy
of a fork. Each is compiled once per shape bucket; the host side (rlkjax.engine.engine) only schedules.

Shapes: prefill tokens [B, C], decode tokens [B, 1] (a round: [B]), page table [B, pages_per_seq],
per-row sampling options `RowSampling` ([B] arrays); B is a power of two up to max_batch. A decode
program's static settings are one `Decoding` value. The KV cache is a parameter of its own, between the
tokens and the page table: it is donated (a program writes its pages in place), and a program's
arguments keep one order from call to call, the order of its compiled inputs.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rlkjax.core.config import ModelConfig
from rlkjax.core.model import forward, sample
from rlkjax.core.numerics import Numerics
from rlkjax.core.sampling_params import at_stop


@functools.partial(jax.jit, static_argnames=("cfg", "numerics"), donate_argnames=("kv_cache",))
def prefill_chunk(params, tokens, positions, kv_cache, page_table, rope, cfg, numerics):
    """Write a chunk of prompt tokens [B, C] into the cache (their hidden states are not needed)."""
    return forward(params, tokens, positions, kv_cache, page_table, rope, cfg, numerics)[1]


class RowSampling(NamedTuple):
    """A decode call's per-row sampling options, one pytree: [B] each (stop_ids [B, S])."""

    seeds: jax.Array  # uint32: the request's sample seed
    steps: jax.Array  # int32: tokens sampled so far; the next token's key is (seed, steps)
    temps: jax.Array  # float32: 0 is greedy
    budget: jax.Array  # int32: tokens the row may still sample
    stop_ids: jax.Array  # int32 [B, S], -1 pads
    min_tokens: jax.Array  # int32: no stop id ends the row before it has this many tokens
    # (top_k [B] (vocab: off), top_p, min_p, renormalised [B] bool), or None: no row truncates (the
    # default variant; a truncating round runs another)
    truncation: tuple | None = None

    @staticmethod
    def idle(rows: int) -> "RowSampling":
        """Rows that sample nothing (budget 0): what warm-up runs."""
        zeros = np.zeros(rows, np.int32)
        return RowSampling(
            np.zeros(rows, np.uint32), zeros, np.ones(rows, np.float32), zeros, np.full((rows, 1), -1, np.int32), zeros
        )


@dataclasses.dataclass(frozen=True)
class Decoding:
    """A decode program's static settings, one hashable value (the jit's static argument: one compile each)."""

    cfg: ModelConfig
    numerics: Numerics = "strict"
    num_steps: int = 1  # decode steps per round (a round's; a step is one)
    # k > 0: also each row's k most likely ids and their logprobs (a separate variant: it materialises
    # [B, vocab] fp32 logits)
    top_logprobs: int = 0


class RoundStart(NamedTuple):
    """The tokens `next_round`'s rows start from: the round before's last token where a row continues
    it (that round is not read by the host yet, so its last tokens and stops stay on the device), else
    the host's token."""

    carry: tuple  # (last token [C], stopped [C]) of the previous round's rows (padded to C rows)
    src: jax.Array  # [B] int32: the previous round's row a row continues; -1: a row from the host
    tokens: jax.Array  # [B] int32: the token a row from the host is fed


@functools.partial(jax.jit, static_argnames=("decoding",), donate_argnames=("kv_cache",))
def decode_step(params, tokens, positions, kv_cache, page_table, sampling: RowSampling, rope, decoding: Decoding):
    """Feed one token per row [B, 1]; sample the next with keys (seed, step); temperature 0 is
    greedy. With `decoding.top_logprobs` = k > 0 also returns each row's k most likely ids and their
    logprobs [B, k]; the tokens and logprobs are the same bits either way. With `sampling.truncation`
    draws from the truncated distribution (a row with nothing truncated draws the default path's
    token and bits) and records the full or, where `renormalised`, the renormalised logprob."""
    cfg, numerics, top_logprobs = decoding.cfg, decoding.numerics, decoding.top_logprobs
    hidden, kv_cache = forward(params, tokens, positions, kv_cache, page_table, rope, cfg, numerics)
    truncation = None if sampling.truncation is None else sampling.truncation[:3]  # (top_k, top_p, min_p)
    out = sample(
        params, hidden[:, 0], sampling.seeds, sampling.steps, sampling.temps, numerics, top_logprobs, truncation
    )
    logprobs = out.logprobs if truncation is None else jnp.where(sampling.truncation[3], out.renormalised, out.logprobs)
    return out.tokens, logprobs, kv_cache, *((out.top_ids, out.top_logprobs) if top_logprobs else ())


@functools.partial(jax.jit, static_argnames=("decoding",), donate_argnames=("kv_cache",))
def decode_round(params, tokens, positions, kv_cache, page_table, sampling: RowSampling, rope, decoding: Decoding):
    """Up to `decoding.num_steps` decode steps on the device per host round trip.

    tokens, positions [B]. Every step is exactly `decode_step` (same forward, same sample, keys
    (seed, steps + i)), so a round gives the bits single steps give. A row stops after sampling its
    budget, or one of its stop ids once it has min_tokens tokens (a stop id drawn earlier is kept as
    an ordinary token: the distribution is never changed, so the logprobs stay the learner's); from
    then on it is fed as padding (position -1: written to the trash page, read by nobody). Returns
    tokens [B, num_steps] (-1 after a row stopped), their logprobs, and the cache; with
    `top_logprobs` = k > 0 also top ids and logprobs [B, num_steps, k].

    The loop always runs num_steps steps: a loop that ended once every row stopped would need the
    host to read its condition after every step, and XLA:GPU's dispatch then blocks the host for
    the whole round (bench/results/2026-11-30_h200_server_burst_0.6b.json), so the host could not
    plan the next round while this one runs. A round whose rows all stop early (the last
    one of a batch) runs its remaining steps on padding.
    """
    rows, num_steps, top_logprobs = tokens.shape[0], decoding.num_steps, decoding.top_logprobs
    steps, budget, stop_ids, min_tokens = sampling.steps, sampling.budget, sampling.stop_ids, sampling.min_tokens

    def body(i, carry):
        tok, pos, active, cache, out = carry
        fed = jnp.where(active, pos, -1)
        fed_tokens, fed_positions = tok[:, None], fed[:, None]
        at_step = sampling._replace(steps=steps + i)  # keys (seed, steps + i)
        nxt, lp, cache, *top = decode_step(
            params, fed_tokens, fed_positions, cache, page_table, at_step, rope, decoding
        )
        nxt = jnp.where(active, nxt, -1)
        new = (nxt, jnp.where(active, lp, jnp.zeros_like(lp)), *top)
        out = tuple(jax.lax.dynamic_update_index_in_dim(o, x, i, axis=1) for o, x in zip(out, new))
        stop = at_stop(nxt, steps + i + 1, stop_ids, min_tokens) | (i + 1 >= budget)
        return jnp.where(active, nxt, tok), pos + 1, active & ~stop, cache, out

    out = (jnp.full((rows, num_steps), -1, jnp.int32), jnp.zeros((rows, num_steps), jnp.float32))
    if top_logprobs:
        k = (rows, num_steps, top_logprobs)
        out += (jnp.zeros(k, jnp.int32), jnp.zeros(k, jnp.float32))
    *_, kv_cache, out = jax.lax.fori_loop(0, num_steps, body, (tokens, positions, budget > 0, kv_cache, out))
    return out[0], out[1], kv_cache, *out[2:]


@functools.partial(jax.jit, static_argnames=("decoding",), donate_argnames=("kv_cache",))
def next_round(params, start: RoundStart, positions, kv_cache, page_table, sampling: RowSampling, rope, decoding):
    """`decode_round` whose rows may continue the round before it, which the host has not read yet.

    start: where each row's first token comes from (`RoundStart`). The host knows every other input
    of a continuing row exactly (a row that did not stop sampled its whole budget), so only the last
    token and whether the row stopped come from the device; a stopped row gets no budget (it samples
    nothing, writes only the trash page). Integer selects and gathers only: the forward and the
    sample are decode_round's. Returns decode_round's outputs and this round's carry."""
    carry, src = start.carry, start.src
    take = src >= 0
    row = jnp.maximum(src, 0)
    tokens = jnp.where(take, carry[0][row], start.tokens)
    budget = jnp.where(take & carry[1][row], 0, sampling.budget)
    sampling = sampling._replace(budget=budget)
    out_tok, out_lp, kv_cache, *top = decode_round(
        params, tokens, positions, kv_cache, page_table, sampling, rope, decoding
    )
    steps, stop_ids, min_tokens = sampling.steps, sampling.stop_ids, sampling.min_tokens
    produced = jnp.sum(out_tok >= 0, axis=1)
    last = jnp.take_along_axis(out_tok, jnp.maximum(produced - 1, 0)[:, None], axis=1)[:, 0]
    last = jnp.where(produced > 0, last, tokens)
    # The stop rule read off the round's last token: a row that sampled less than its budget stopped there.
    stopped = (budget <= 0) | (at_stop(last, steps + produced, stop_ids, min_tokens) & (produced > 0))
    pad = carry[0].shape[0] - tokens.shape[0]
    carry = (jnp.pad(last, (0, pad)), jnp.pad(stopped, (0, pad), constant_values=True))
    return out_tok, out_lp, kv_cache, carry, *top


@functools.partial(jax.jit, donate_argnames=("kv_cache",))
def copy_pages(kv_cache, src, dst):
    """Copy-on-write: pages dst <- pages src in every layer (data movement only)."""
    return tuple(c.at[:, :, dst].set(c[:, :, src]) for c in kv_cache)
