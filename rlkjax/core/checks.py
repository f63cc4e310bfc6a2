"""Request validation, in one place: `SamplingParams`, `rlkjax.generate`, `rlkjax.score`, the
engine's `submit` and the HTTP server (which only translates HTTP to these calls) all check their
inputs with these helpers, so a bad value gets the same clear `ValueError` whichever door it came
through."""

import math
import reprlib

import numpy as np

SEED_LIMIT = 2**32
# Smallest temperature accepted. Logits are divided by T in float32 inside the kernels: at T = 1e-4
# a logit of 1e30 would still be finite, while float32 underflow (1e-46 -> 0) or overflow near
# T ~ 1e-38 would give NaN logprobs. Below this, ask for greedy decoding: temperature 0.
MIN_TEMPERATURE = 1e-4
MAX_TOP_LOGPROBS = 20  # top logprobs per token (OpenAI's limit); one compiled decode variant serves every k
_GOLDEN = 0x9E3779B9


def most_top_logprobs(vocab_size: int) -> int:
    """The most top logprobs a row may ask for with this vocabulary: every program that lists top logprobs
    lists this many and a request keeps its first k (sorted by value, ties by id: the same bits as k)."""
    return min(MAX_TOP_LOGPROBS, vocab_size)


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a request with seed `seed`: seed + index * golden (mod 2**32).
    Sample 0 uses the request's seed. Linear on purpose: sample_seed(sample_seed(s, a), b) ==
    sample_seed(s, a + b), so prompt i of a batch request with n samples each can start at
    sample_seed(s, i * n) and every sequence of the batch gets a distinct seed."""
    return (seed + index * _GOLDEN) % SEED_LIMIT


_SHORT = reprlib.Repr(maxstring=60, maxlong=40, maxlist=6, maxdict=4, maxlevel=3)


def shown(value) -> str:
    """A client's value as an error message quotes it: its repr, cut short (a 100,000-character
    string or a 400-digit integer would otherwise be sent back whole)."""
    return _SHORT.repr(value)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_float(value) -> float:
    """A number as a float64; an integer too large for one (JSON allows 10**400) is NaN, so the
    finiteness checks refuse it instead of raising OverflowError."""
    try:
        return float(value)
    except OverflowError:
        return math.nan


def check_int(name: str, value, lo: int, hi: int | None = None) -> int:
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an integer {bound}, got {shown(value)}")
    return int(value)


def check_tokens(name: str, tokens, vocab_size: int) -> list[int]:
    """One non-empty sequence of token ids in [0, vocab_size). Checked in Python, element by element,
    before anything becomes an array: an id too large for int64 (JSON allows 10**400) or a nested
    list is the client's error, not an OverflowError or a ragged-array error from numpy."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (list, tuple, np.ndarray)):
        raise ValueError(f"{name} must be a non-empty list of token ids, got {type(tokens).__name__}")
    if isinstance(tokens, np.ndarray) and tokens.ndim != 1:
        raise ValueError(f"{name} must be a non-empty 1-D list of token ids, got shape {tokens.shape}")
    if len(tokens) == 0:
        raise ValueError(f"{name} must be a non-empty 1-D list of token ids, got shape (0,)")
    if isinstance(tokens, np.ndarray) and np.issubdtype(tokens.dtype, np.integer):  # the learner's batches: vectorised
        bad = tokens[(tokens < 0) | (tokens >= vocab_size)]
        if bad.size:
            raise ValueError(f"{name} has token id {int(bad[0])} outside [0, {vocab_size})")
        return tokens.astype(np.int64).tolist()
    for t in tokens:
        if isinstance(t, (list, tuple, np.ndarray)):
            raise ValueError(f"{name} must be a non-empty 1-D list of token ids, got a nested list {shown(t)}")
        if not _is_int(t):
            raise ValueError(f"{name} must hold integer token ids, got {shown(t)}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{name} has token id {shown(int(t))} outside [0, {vocab_size})")
    return [int(t) for t in tokens]


def check_batch(name: str, sequences, vocab_size: int) -> list[list[int]]:
    """A non-empty list of token-id sequences."""
    if not isinstance(sequences, (list, tuple)) or not sequences:
        raise ValueError(f"{name} must be a non-empty list of token-id lists")
    return [check_tokens(f"{name}[{i}]", s, vocab_size) for i, s in enumerate(sequences)]


def check_temperature(name: str, value, greedy: bool = False) -> float:
    """0 (greedy, where `greedy` allows it) or a finite number >= MIN_TEMPERATURE, checked as the
    float32 the kernels divide by (1e-46 passes a float64 `> 0` check, becomes 0 in float32 and
    would be greedy, or NaN logprobs, instead of the tiny temperature asked for). Greedy rows take
    the argmax and record (and score) temperature-1 logprobs. Off by default: the learner
    (train.grpo) refuses 0, since a group of greedy samples is one sample G times (zero advantage)."""
    if not _is_number(value):
        raise ValueError(f"{name} must be a number, got {shown(value)}")
    if greedy and value == 0:
        return 0.0  # -0.0 too: the kernels test `T == 0`
    t32 = np.float32(value) if math.isfinite(as_float(value)) else np.float32("nan")
    if not (np.isfinite(t32) and t32 >= np.float32(MIN_TEMPERATURE)):
        zero = "0 (greedy) or " if greedy else ""
        raise ValueError(f"{name} must be {zero}finite and >= {MIN_TEMPERATURE}, got {shown(value)}")
    return float(value)


def check_fraction(name: str, value, lo: float, hi: float, lo_open: bool = False) -> float:
    """A number in [lo, hi] ((lo, hi] if lo_open), checked as the float32 the kernels compare with."""
    if not _is_number(value):
        raise ValueError(f"{name} must be a number, got {shown(value)}")
    v32 = np.float32(value) if math.isfinite(as_float(value)) else np.float32("nan")
    if not (np.isfinite(v32) and (v32 > lo if lo_open else v32 >= lo) and v32 <= hi):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {shown(value)}")
    return float(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be true or false, got {shown(value)}")
    return bool(value)


def check_seed(name: str, value) -> int:
    return check_int(name, value, 0, SEED_LIMIT - 1)


def per_row(name: str, value, n: int) -> list:
    """A scalar broadcast to n rows, or a list of exactly n values."""
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * n
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} sequences")
    return values
