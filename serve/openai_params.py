"""The OpenAI routes' request bodies, read into one checked `Sampling`: the engine's SamplingParams
plus what only the HTTP layer needs (stop strings, echo, streaming, the response's options).
Field names are OpenAI's and vLLM's; a bad value is a BadRequest naming the field."""

import dataclasses
import math

from rlkjax.requests import as_float, check_int, most_alternatives, shown
from rlkjax.sampling_params import SamplingParams
from serve.http import BadRequest, _opt, check_context

COMMON_FIELDS = {
    "model",
    "max_tokens",
    "temperature",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "user",
    "stop_token_ids",
    "include_stop_str_in_output",
    "return_token_ids",
    "timeout",
    "top_k",
    "top_p",
    "min_p",
    "min_tokens",
    "ignore_eos",
    "truncated_logprobs",
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "add_generation_prompt",
    "chat_template_kwargs",
    "tools",
    "tool_choice",
}


@dataclasses.dataclass
class Sampling:
    """What one request asks for, validated."""

    params: SamplingParams  # what the engine samples with (its max_tokens at least 1)
    max_tokens: int  # 0: echo only, nothing sampled
    stop: list[str]
    include_stop: bool
    logprobs: bool
    echo: bool
    return_token_ids: bool
    stream: bool
    include_usage: bool
    timeout: float | None


def bool_field(body, name, default=False) -> bool:
    value = _opt(body, name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {shown(value)}")
    return value


MAX_STOPS, MAX_STOP_CHARS = 32, 1024  # stop strings are searched after every token on the engine thread


def _stop_strings(value) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a non-empty string or a list of them")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise BadRequest(f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")
    return stops


def _int_list(body, name) -> list[int]:
    value = _opt(body, name, [])
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest(f"{name} must be a list of token ids")
    return value


def _timeout(value) -> float | None:
    """Seconds, as a finite float: asyncio adds it to the clock, and an integer too large for a
    float (10**400) would raise OverflowError there, after the request was submitted."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < as_float(value) < math.inf:
        raise BadRequest(f"timeout must be a finite number of seconds > 0, got {shown(value)}")
    return float(value)


def sampling(server, body: dict, *, chat: bool, prompt_len: int) -> Sampling:
    """The request's sampling fields, checked; the engine checks the rest (n, ids, lengths) with its own messages."""
    most = most_alternatives(server.cfg.vocab_size)
    if chat:
        logprobs = bool_field(body, "logprobs")
        top = _opt(body, "top_logprobs", 0)
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= most:
            raise BadRequest(f"top_logprobs must be null or an integer in [0, {most}], got {shown(top)}")
        if top and not logprobs:
            raise BadRequest("top_logprobs needs logprobs: true")
        default_max = max(server.engine.max_context - prompt_len, 1)  # OpenAI's chat default: up to the context
        max_tokens = _opt(body, "max_completion_tokens", _opt(body, "max_tokens", default_max))
        echo = False
    else:
        lp = body.get("logprobs")
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= most):
            raise BadRequest(
                f"logprobs must be null or an integer in [0, {most}] (top alternatives per token), got {shown(lp)}"
            )
        top = lp or 0
        logprobs, max_tokens, echo = lp is not None, _opt(body, "max_tokens", 16), bool_field(body, "echo")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise BadRequest(f"max_tokens must be an integer >= 0, got {shown(max_tokens)}")
    if max_tokens == 0 and not echo:
        raise BadRequest("max_tokens 0 asks for no tokens: it is only allowed with echo (the prompt's logprobs)")
    stream = bool_field(body, "stream")
    options = _opt(body, "stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest('stream_options must be {"include_usage": true|false}')
    if options and not stream:
        raise BadRequest("stream_options is only allowed with stream: true")
    timeout = _timeout(_opt(body, "timeout", None))
    top_k = _opt(body, "top_k", 0)
    top_k = 0 if top_k == -1 and not isinstance(top_k, bool) else top_k  # vLLM's "off" is -1 (ours: 0)
    field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    check_context(server.engine.max_context, prompt_len, max(max_tokens, 1), field)  # vLLM's wording
    try:
        params = SamplingParams(
            n=_opt(body, "n", 1),
            max_tokens=max(max_tokens, 1),
            temperature=_opt(body, "temperature", 1.0),
            stop_token_ids=_int_list(body, "stop_token_ids"),
            min_tokens=_opt(body, "min_tokens", 0),
            ignore_eos=_opt(body, "ignore_eos", False),
            top_logprobs=top,
            top_k=top_k,
            top_p=_opt(body, "top_p", 1.0),
            min_p=_opt(body, "min_p", 0.0),
            truncated_logprobs=_opt(body, "truncated_logprobs", False),
        )
        params.check_model(server.cfg.vocab_size, server.engine.max_context)
        check_int("n", params.n, 1, server.engine.config.max_batch)  # before the job sizes anything by n
    except ValueError as e:  # completions call the alternatives logprobs
        raise BadRequest(str(e) if chat else str(e).replace("top_logprobs", "logprobs (top alternatives)")) from None
    return Sampling(
        params=params,
        max_tokens=max_tokens,
        stop=_stop_strings(body["stop"]) if body.get("stop") is not None else [],
        include_stop=bool_field(body, "include_stop_str_in_output"),
        logprobs=logprobs,
        echo=echo,
        return_token_ids=bool_field(body, "return_token_ids"),
        stream=stream,
        include_usage=bool_field(options, "include_usage"),
        timeout=timeout,
    )
