"""`SamplingParams`: what one request asks the sampler for, as one frozen value with vLLM's field
names, checked once when it is built. `check_model` adds the checks that need the model (its
vocabulary and context). `rlkjax.generate`, `Engine.submit`, the server's routes and train.grpo's
rollouts all take this one value, so an option is spelled, defaulted and validated in one place.

Here too, once for every caller: the eos policy (`SamplingParams.stop_ids`) and the stop rule
(`at_stop`), which the engine applies on the device and on the host."""

import dataclasses

import numpy as np

from rlkjax.core.checks import (
    MAX_TOP_LOGPROBS,
    check_bool,
    check_fraction,
    check_int,
    check_seed,
    check_temperature,
    shown,
)

TOP_K_LIMIT = 2**31 - 1  # the kernels take top_k as int32; any k >= the vocabulary is "off"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Samples drawn for the prompt; sample j uses seed `sample_seed(seed, j)`."""
    max_tokens: int = 16
    """Most tokens sampled per completion."""
    temperature: float = 1.0
    """Tokens are drawn from softmax(logits / temperature); 0 is greedy (argmax, ties to the lowest id;
    logprobs of the temperature-1 distribution)."""
    seed: int = 0
    """Sampling key of token t of sample 0 derives from (seed, t) only, never from the batch."""
    stop_token_ids: tuple[int, ...] = ()
    """Ids that end a completion (kept in it, with its logprob), once it has min_tokens tokens."""
    min_tokens: int = 0
    """A stop id sampled before the completion has this many tokens is an ordinary token (the
    distribution is not changed, unlike vLLM's min_tokens, so the logprobs stay the learner's)."""
    ignore_eos: bool = False
    """Do not stop at the model's end-of-sequence id."""
    top_logprobs: int = 0
    """Per token, the k most likely ids of the full distribution and their logprobs (vLLM: logprobs)."""
    top_k: int = 0
    """Draw from the k most likely ids only (0: off); see pallas_kernels/truncation.py."""
    top_p: float = 1.0
    """Draw from the smallest set of ids holding this probability mass (1: off)."""
    min_p: float = 0.0
    """Draw only ids at least this fraction of the most likely one's probability (0: off)."""
    truncated_logprobs: bool = False
    """Record logprobs of the renormalised truncated distribution instead of the full one (the
    learner's); not with top_logprobs, whose values are the full distribution's."""
    prompt_logprobs: int | None = None
    """rlkjax.generate only: the learner's logprobs of prompt[1:] and, for k > 0, k top logprobs
    per position (None: off)."""

    def __post_init__(self):
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, set, frozenset, np.ndarray)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {shown(ids)}")
        fields = dict(
            n=check_int("n", self.n, 1),
            max_tokens=check_int("max_tokens", self.max_tokens, 1),
            temperature=check_temperature("temperature", self.temperature, greedy=True),
            seed=check_seed("seed", self.seed),
            stop_token_ids=tuple(sorted({check_int("stop_token_ids[]", t, 0) for t in ids})),
            ignore_eos=check_bool("ignore_eos", self.ignore_eos),
            top_logprobs=check_int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS),
            top_k=check_int("top_k", self.top_k, 0, TOP_K_LIMIT),
            top_p=check_fraction("top_p", self.top_p, 0.0, 1.0, lo_open=True),
            min_p=check_fraction("min_p", self.min_p, 0.0, 1.0),
            truncated_logprobs=check_bool("truncated_logprobs", self.truncated_logprobs),
        )
        fields["min_tokens"] = check_int("min_tokens", self.min_tokens, 0, fields["max_tokens"])
        if self.prompt_logprobs is not None:
            fields["prompt_logprobs"] = check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS)
        if fields["truncated_logprobs"] and fields["top_logprobs"]:
            raise ValueError(
                "truncated_logprobs cannot be combined with top_logprobs (top logprobs are full-distribution)"
            )
        for name, value in fields.items():  # normalised: plain Python ints, floats and a sorted tuple
            object.__setattr__(self, name, value)

    @property
    def truncates(self) -> bool:
        """Drawn from a truncated distribution, or recording renormalised logprobs."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0 or self.truncated_logprobs

    def stop_ids(self, eos_token_id: int | None) -> tuple[int, ...]:
        """The eos policy: the ids that end a sample are stop_token_ids and, unless ignore_eos, the
        model's eos (None: the model has none). A sampled eos belongs to the completion (returned
        with its logprob, and trained on) like any stop id."""
        eos = () if eos_token_id is None or self.ignore_eos else (eos_token_id,)
        return tuple(sorted(set(self.stop_token_ids) | set(eos)))

    def check_model(self, vocab_size: int, context: int, prompt_len: int = 0) -> None:
        """The checks that need the model: ids inside its vocabulary, at most `vocab_size`
        top logprobs, and prompt_len + max_tokens within `context` tokens. Raises ValueError naming
        the field."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids has token id {shown(t)} outside [0, {vocab_size})")
        for name in ("top_logprobs", "prompt_logprobs"):
            if (getattr(self, name) or 0) > vocab_size:
                raise ValueError(f"{name} must be an integer in [0, {vocab_size}], got {shown(getattr(self, name))}")
        if prompt_len + self.max_tokens > context:
            raise ValueError(
                f"prompt ({prompt_len}) + max_tokens ({shown(self.max_tokens)}) exceeds the context of {context} tokens"
            )


def at_stop(token, generated, stop_ids, min_tokens):
    """The stop rule, for numpy and jax arrays alike: `token` [...], a sample's `generated`-th token,
    ends the sample if it is one of `stop_ids` [..., S] (-1 pads) and generated >= min_tokens. A
    stop id sampled earlier is an ordinary token. (Sampling max_tokens tokens ends it too: the
    callers count that themselves.)"""
    return (token[..., None] == stop_ids).any(axis=-1) & (generated >= min_tokens)
