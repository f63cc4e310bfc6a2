"""The rollout engine's settings (rlkjax.engine.engine): KV cache pages, batch slots, prefill chunk and budget,
decode round length, prefix cache; the scheduler's knobs (rlkjax.engine.scheduler) and the server's flags
(serve.config)."""

import dataclasses

from rlkjax.core.numerics import PAGE_SIZE
from rlkjax.core.shapes import bucket, cdiv


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    num_pages: int = 2048
    """KV cache size in pages of 16 tokens (page 0 reserved)."""
    max_batch: int = 64
    """Most sequences in flight (and in one decode step); also the largest n per request."""
    prefill_chunk: int = 128
    """Prompt tokens per sequence per prefill call."""
    token_budget: int = 4096
    """Prompt tokens prefilled per engine step (across sequences). Larger admits new requests faster
    (time to first token) and keeps the batch fuller; each step's prefill delays the running rows'
    next tokens (the default's measurement: bench/results/2026-12-03_h200_cpu_measurements_behind_defaults.md)."""
    max_context: int | None = None
    """Longest prompt + max_tokens accepted (default: the model's max_position)."""
    decode_steps: int = 8
    """Decode steps per host round trip (a loop on the device; sequences join and leave between rounds)."""
    prefix_cache: bool = True
    """Keep the full KV pages of sequences that end, addressable by their token prefix: a request that
    extends a cached prefix (an episode's next turn, the same prompt again) prefills only the rest, with
    the same bits. Kept pages count as free (evicted least recently used first); --no-prefix-cache
    frees them at once."""

    def __post_init__(self):
        for name in ("num_pages", "max_batch", "prefill_chunk", "token_budget", "decode_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be >= 2 (page 0 is reserved)")
        if self.token_budget < self.prefill_chunk:
            raise ValueError(f"token_budget={self.token_budget} must be >= prefill_chunk={self.prefill_chunk}")
        if self.max_context is not None and self.max_context <= 0:
            raise ValueError(f"max_context={self.max_context} must be positive")

    @staticmethod
    def for_batch(lengths, prefill_chunk: int = 64) -> "EngineConfig":
        """An engine that runs a fixed batch of sequences at once, nothing preempted, nothing idle:
        `lengths` holds each sequence's prompt + new tokens (what `generate` and the learner's
        rollout size their engines with)."""
        rows = bucket(len(lengths))
        return EngineConfig(
            num_pages=1 + sum(cdiv(n, PAGE_SIZE) for n in lengths),
            max_batch=rows,
            prefill_chunk=prefill_chunk,
            token_budget=prefill_chunk * rows,
            max_context=max(lengths),
        )

    @staticmethod
    def for_budget(num_pages: int, rows: int, max_length: int, group: int, prefill_chunk: int = 64) -> "EngineConfig":
        """An engine for `rows` sequences of up to `max_length` tokens (prompt + new tokens) in a KV cache of
        `num_pages` pages (page 0 included), in requests of up to `group` samples: sequences are admitted as
        pages free up, and one that must give its pages back is prefilled again later (same tokens, same bits).

        Batch slots: twice the sequences that fit at full length (completions that end at their eos, most of
        them well before max_length in a reasoning run, leave their pages to the others; if all run to full
        length, about half are preempted once), at most `rows`, at least `group` (the largest n of one request). Not
        rounded up to a power of two as the programs' rows are: that would admit more than the pages were meant for.
        With pages for every row at full length it runs as `for_batch([max_length] * rows)` (its batch slots
        rounded up to a power of two, which only rows sequences ever fill)."""
        per_sequence = cdiv(max_length, PAGE_SIZE)
        if num_pages - 1 < per_sequence:
            raise ValueError(
                f"num_pages={num_pages} holds no sequence of {max_length} tokens "
                f"({per_sequence} pages and the trash page)"
            )
        if not 0 < group <= rows:
            raise ValueError(f"group={group} must be in [1, rows={rows}]")
        slots = max(group, min(rows, 2 * ((num_pages - 1) // per_sequence)))
        return EngineConfig(
            num_pages=num_pages,
            max_batch=slots,
            prefill_chunk=prefill_chunk,
            token_budget=prefill_chunk * bucket(slots),
            max_context=max_length,
        )
