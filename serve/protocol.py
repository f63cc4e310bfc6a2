"""The request bodies of the generation routes as typed values, each read and checked once from its JSON
body: `GenerateRequest` (POST /generate), `CompletionRequest` (/v1/completions), `ChatCompletionRequest`
(/v1/chat/completions) and `TokenGenerateRequest` (/inference/v1/generate). A bad field is a BadRequest
naming it as the client spelled it (OpenAI's error shape, serve.http); `to_sampling_params()` gives the
one `rlkjax.SamplingParams` the engine samples with, and cannot fail once `parse` succeeded.

Names inside are the engine's (max_tokens, top_logprobs); the wire's other names are read only here:
/generate's max_new_tokens, the completions route's logprobs=k and the token route's
sampling_params.logprobs=k (both top_logprobs), chat's max_completion_tokens. A request without a seed
gets a fresh one from the OS, reported in the response so the sample can be redone.
"""

import dataclasses
import math
import secrets
import uuid

from rlkjax.core.checks import as_float, check_int, check_seed, check_tokens, most_top_logprobs, sample_seed, shown
from rlkjax.core.sampling_params import SamplingParams
from rlkjax.text.chat import ChatTemplateError
from serve.http import BadRequest, check_context, check_fields, optional, token_prompts
from serve.tool_calls import history_message, request_tools

COMMON_FIELDS = {
    *("model", "max_tokens", "temperature", "n", "seed", "stop", "stream", "stream_options", "user"),
    *("stop_token_ids", "include_stop_str_in_output", "return_token_ids", "timeout", "top_k", "top_p", "min_p"),
    *("min_tokens", "ignore_eos", "truncated_logprobs"),
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {
    *("messages", "logprobs", "top_logprobs", "max_completion_tokens", "add_generation_prompt"),
    *("chat_template_kwargs", "tools", "tool_choice"),
}
MAX_STOPS, MAX_STOP_CHARS = 32, 1024  # stop strings are searched after every token on the engine thread


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a body is checked against: the served model's and the server's limits."""

    vocab_size: int
    max_context: int  # tokens of prompt + completion
    max_batch: int  # most samples (n) of one prompt
    max_prompts: int  # most prompts in one request

    def check_prompts(self, prompts: list) -> None:
        if len(prompts) > self.max_prompts:
            raise BadRequest(f"at most {self.max_prompts} prompts per request, got {len(prompts)}")


# ----- fields -----
def bool_field(body: dict, name: str, default=False) -> bool:
    value = optional(body, name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {shown(value)}")
    return value


def timeout_field(value) -> float | None:
    """Seconds, as a finite float: asyncio adds it to the clock, and an integer too large for a
    float (10**400) would raise OverflowError there, after the request was submitted."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < as_float(value) < math.inf:
        raise BadRequest(f"timeout must be a finite number of seconds > 0, got {shown(value)}")
    return float(value)


def stop_strings(value) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a non-empty string or a list of them")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise BadRequest(f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")
    return stops


def int_list(body: dict, name: str) -> list[int]:
    value = optional(body, name, [])
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest(f"{name} must be a list of token ids")
    return value


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A prompt's text as token ids; JSON can carry lone surrogates ("\\ud800"), which are not text: a 400."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"prompt is not valid Unicode: {e.reason} at character {e.start}") from None
    return tokenizer.encode(text)


def top_k_field(body: dict):
    top_k = optional(body, "top_k", 0)
    return 0 if top_k == -1 and not isinstance(top_k, bool) else top_k  # vLLM's "off" is -1 (ours: 0)


def seeds_for(seed, prompts: int, n: int) -> tuple[list, int | list]:
    """(one seed per prompt, the seed to report). A list: one seed per prompt, taken as given. An int
    s: prompt i starts at sample_seed(s, i * n), so every sequence of the batch draws its own noise.
    None: a fresh seed from the OS (a fixed default would give every unseeded request the same completion)."""
    if seed is None:
        seed = secrets.randbits(32)
    if isinstance(seed, list):
        if len(seed) != prompts:
            raise BadRequest(f"seed must be an integer or a list of {prompts} integers (one per prompt)")
        return seed, seed
    try:
        seed = check_seed("seed", seed)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return [sample_seed(seed, i * n) for i in range(prompts)], seed


# ----- the engine's options, shared by every route -----
def sampling_params(fields: dict, top_logprobs_name: str = "top_logprobs") -> SamplingParams:
    """The engine's SamplingParams from a body's values under the engine's names; ValueError naming a bad
    field. top_logprobs is checked against truncated_logprobs under the name the route's clients send it as."""
    if fields.get("truncated_logprobs") and fields.get("top_logprobs"):
        SamplingParams(**fields | {"top_logprobs": 0})  # every other check first, in SamplingParams' order
        raise ValueError(
            f"truncated_logprobs cannot be combined with {top_logprobs_name} (top logprobs are full-distribution)"
        )
    return SamplingParams(**fields)


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """What every generation route's body gives the engine: one SamplingParams, built and checked once,
    and one seed per prompt."""

    params: SamplingParams
    seeds: tuple[int, ...]  # prompt i's seed (its samples' derive from it)
    seed: int | list  # as the response reports it: the request's seed, or the fresh one it got

    def to_sampling_params(self) -> SamplingParams:
        """The engine's options for every prompt (each prompt's seed is given at submission)."""
        return self.params


# ----- POST /generate -----
@dataclasses.dataclass(frozen=True)
class GenerateRequest(GenerationRequest):
    """POST /generate: {"prompt": ids or a list of them, "n", "max_new_tokens", "temperature", "seed",
    "stop_token_ids", "ignore_eos"}; max_new_tokens is this route's name for max_tokens."""

    prompts: tuple[tuple[int, ...], ...]
    FIELDS = {"prompt", "n", "max_new_tokens", "temperature", "seed", "stop_token_ids", "ignore_eos"}
    MAX_TOKENS = "max_new_tokens"  # what the engine's max_tokens is called in this route's messages

    @classmethod
    def parse(cls, body: dict, limits: Limits) -> "GenerateRequest":
        check_fields(body, cls.FIELDS, {"prompt"})
        prompts = token_prompts(body["prompt"])
        limits.check_prompts(prompts)
        n, max_tokens = optional(body, "n", 1), optional(body, "max_new_tokens", 16)
        try:
            check_int("n", n, 1)  # SamplingParams' order: n, then max_tokens (under this route's name)
            check_int(cls.MAX_TOKENS, max_tokens, 1)
            fields = dict(
                n=n,
                max_tokens=max_tokens,
                temperature=optional(body, "temperature", 1.0),
                stop_token_ids=optional(body, "stop_token_ids", []),
                ignore_eos=optional(body, "ignore_eos", False),
            )
            params = sampling_params(fields)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        seeds, seed = seeds_for(body.get("seed"), len(prompts), n)
        return cls(params, tuple(seeds), seed, prompts=tuple(map(tuple, prompts)))


# ----- POST /inference/v1/generate (vLLM's token route) -----
TOKEN_FIELDS = {
    *("model", "token_ids", "sampling_params", "request_id", "stream", "stream_options", "cache_salt"),
    *("priority", "kv_transfer_params", "features", "timeout"),
}
HONOURED = {
    *("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "stop_token_ids"),
    *("ignore_eos", "logprobs", "truncated_logprobs"),
}
HARMLESS = {
    *("detokenize", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"),
    *("output_kind", "stream_interval", "skip_clone", "flat_logprobs", "skip_reading_prefix_cache"),
    *("routed_experts_prompt_start", "extra_args"),
}
NEUTRAL = {  # vLLM's default; null, [], {} and "" count as unset too
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "use_beam_search": False,
    "early_stopping": False,
    "stop": None,
    "prompt_logprobs": None,
    "prompt_logprob_token_ids": None,
    "prompt_logprob_start": None,
    "logprob_token_ids": None,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "structured_outputs": None,
    "guided_decoding": None,
    "logits_processors": None,
    "truncate_prompt_tokens": None,
    "thinking_token_budget": -1,
    "repetition_detection": None,
    "trace_decode_token_ids": None,
    "best_of": None,  # or equal to n
}


def _unset(value, neutral) -> bool:
    if value is None or (isinstance(value, (list, dict, str)) and not value):
        return True
    if isinstance(neutral, bool):
        return value is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == neutral
    return False


def _check_vllm_fields(sp: dict) -> None:
    unknown = sorted(set(sp) - HONOURED - HARMLESS - set(NEUTRAL))
    if unknown:
        raise BadRequest(f"unknown sampling_params field(s) {shown(unknown)}: not fields of vLLM's SamplingParams")
    for name, neutral in NEUTRAL.items():
        value = sp.get(name)
        if name == "best_of" and value == optional(sp, "n", 1) and not isinstance(value, bool):
            continue
        if not _unset(value, neutral):
            raise BadRequest(
                f"sampling_params.{name}={shown(value)} is not supported by this server (only "
                f"{'null' if neutral is None else neutral}): it would change what is sampled or returned"
            )


@dataclasses.dataclass(frozen=True)
class TokenGenerateRequest(GenerationRequest):
    """POST /inference/v1/generate: {"token_ids", "sampling_params": {vLLM's SamplingParams fields},
    "request_id", "timeout", ...}; sampling_params.logprobs=k is top_logprobs (null: no logprobs)."""

    token_ids: tuple[int, ...]
    logprobs: bool  # sampling_params.logprobs was given: the response carries logprobs
    request_id: str
    timeout: float | None

    @classmethod
    def parse(cls, body: dict, limits: Limits) -> "TokenGenerateRequest":
        check_fields(body, TOKEN_FIELDS, {"token_ids", "sampling_params"})
        try:
            tokens = check_tokens("token_ids", body["token_ids"], limits.vocab_size)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        request_id, timeout = cls._request_fields(body)
        sp = body["sampling_params"]
        if not isinstance(sp, dict):
            raise BadRequest("sampling_params must be an object")
        _check_vllm_fields(sp)
        logprobs, most = sp.get("logprobs"), most_top_logprobs(limits.vocab_size)
        if logprobs is not None and (
            not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= most
        ):
            raise BadRequest(
                f"sampling_params.logprobs must be null or an integer in [0, {most}], got {shown(logprobs)}"
            )
        fields = dict(
            n=optional(sp, "n", 1),
            max_tokens=optional(sp, "max_tokens", max(limits.max_context - len(tokens), 1)),  # vLLM: up to the context
            temperature=optional(sp, "temperature", 1.0),
            stop_token_ids=optional(sp, "stop_token_ids", []),
            min_tokens=optional(sp, "min_tokens", 0),
            ignore_eos=optional(sp, "ignore_eos", False),
            top_logprobs=logprobs or 0,
            top_k=top_k_field(sp),
            top_p=optional(sp, "top_p", 1.0),
            min_p=optional(sp, "min_p", 0.0),
            truncated_logprobs=optional(sp, "truncated_logprobs", False),
        )
        try:
            params = sampling_params(fields)
        except ValueError as e:
            raise BadRequest(f"sampling_params: {e}") from None
        check_context(limits.max_context, len(tokens), params.max_tokens, "sampling_params.max_tokens")
        seeds, seed = seeds_for(sp.get("seed"), 1, params.n)
        extra = dict(token_ids=tuple(tokens), logprobs=logprobs is not None, request_id=request_id, timeout=timeout)
        return cls(params, tuple(seeds), seed, **extra)

    @staticmethod
    def _request_fields(body: dict) -> tuple[str, float | None]:
        """The top-level fields besides token_ids and sampling_params: (request_id, timeout)."""
        if body.get("stream") not in (None, False):
            raise BadRequest("stream must be false on /inference/v1/generate: the response comes whole")
        for name in ("stream_options", "cache_salt", "kv_transfer_params", "features"):
            if body.get(name) is not None:
                raise BadRequest(f"{name} is not supported by this server (only null)")
        priority = body.get("priority")
        if priority is not None and (priority != 0 or isinstance(priority, bool)):
            raise BadRequest(f"priority must be 0: this server schedules in fair turns, got {shown(priority)}")
        request_id = optional(body, "request_id", None)
        request_id = uuid.uuid4().hex if request_id is None else request_id
        if not isinstance(request_id, str) or not 0 < len(request_id) <= 256:
            raise BadRequest(f"request_id must be a string of 1 to 256 characters, got {shown(request_id)}")
        return request_id, timeout_field(optional(body, "timeout", None))


# ----- POST /v1/completions and /v1/chat/completions -----
@dataclasses.dataclass(frozen=True)
class OpenAIRequest(GenerationRequest):
    """What both OpenAI routes ask besides the engine's options."""

    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int  # as asked: 0 is echo only (nothing sampled; params.max_tokens is 1)
    stop: tuple[str, ...]  # stop strings, found in the text as it grows
    include_stop: bool  # vLLM's include_stop_str_in_output
    logprobs: bool  # the response carries token logprobs
    echo: bool
    return_token_ids: bool
    stream: bool
    include_usage: bool
    timeout: float | None


def _openai_fields(body: dict, limits: Limits, prompts: list, chat: bool) -> dict:
    """OpenAIRequest's fields from a body whose prompts are read; the engine checks the rest of what it
    takes (n, ids, lengths) with its own messages."""
    limits.check_prompts(prompts)
    prompt_len, most = max(map(len, prompts), default=0), most_top_logprobs(limits.vocab_size)
    if chat:
        logprobs, top = bool_field(body, "logprobs"), optional(body, "top_logprobs", 0)
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= most:
            raise BadRequest(f"top_logprobs must be null or an integer in [0, {most}], got {shown(top)}")
        if top and not logprobs:
            raise BadRequest("top_logprobs needs logprobs: true")
        default_max = max(limits.max_context - prompt_len, 1)  # OpenAI's chat default: up to the context
        max_tokens = optional(body, "max_completion_tokens", optional(body, "max_tokens", default_max))
        echo = False
    else:  # logprobs=k: k top logprobs per token
        top = body.get("logprobs")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= most):
            raise BadRequest(
                f"logprobs must be null or an integer in [0, {most}] (top logprobs per token), got {shown(top)}"
            )
        logprobs, top, max_tokens, echo = (
            top is not None,
            top or 0,
            optional(body, "max_tokens", 16),
            bool_field(body, "echo"),
        )
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise BadRequest(f"max_tokens must be an integer >= 0, got {shown(max_tokens)}")
    if max_tokens == 0 and not echo:
        raise BadRequest("max_tokens 0 asks for no tokens: it is only allowed with echo (the prompt's logprobs)")
    stream, options = bool_field(body, "stream"), optional(body, "stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest('stream_options must be {"include_usage": true|false}')
    if options and not stream:
        raise BadRequest("stream_options is only allowed with stream: true")
    timeout, top_k = timeout_field(optional(body, "timeout", None)), top_k_field(body)
    field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    check_context(limits.max_context, prompt_len, max(max_tokens, 1), field)  # vLLM's wording
    try:
        fields = dict(
            n=optional(body, "n", 1),
            max_tokens=max(max_tokens, 1),  # 0 (echo only) samples nothing: the route submits nothing
            temperature=optional(body, "temperature", 1.0),
            stop_token_ids=int_list(body, "stop_token_ids"),
            min_tokens=optional(body, "min_tokens", 0),
            ignore_eos=optional(body, "ignore_eos", False),
            top_logprobs=top,
            top_k=top_k,
            top_p=optional(body, "top_p", 1.0),
            min_p=optional(body, "min_p", 0.0),
            truncated_logprobs=optional(body, "truncated_logprobs", False),
        )
        params = sampling_params(fields, "top_logprobs" if chat else "logprobs")
        params.check_model(limits.vocab_size, limits.max_context)
        check_int("n", params.n, 1, limits.max_batch)  # before the route sizes anything by n
    except ValueError as e:
        raise BadRequest(str(e)) from None
    stop = stop_strings(body["stop"]) if body.get("stop") is not None else []
    out = dict(prompts=tuple(map(tuple, prompts)), max_tokens=max_tokens, stop=tuple(stop))
    out |= dict(include_stop=bool_field(body, "include_stop_str_in_output"), logprobs=logprobs, echo=echo)
    out |= dict(return_token_ids=bool_field(body, "return_token_ids"), stream=stream)
    out |= dict(include_usage=bool_field(options, "include_usage"), timeout=timeout)
    seeds, seed = seeds_for(body.get("seed"), len(prompts), params.n)
    return dict(params=params, seeds=tuple(seeds), seed=seed) | out


@dataclasses.dataclass(frozen=True)
class CompletionRequest(OpenAIRequest):
    """POST /v1/completions: prompt as text, a list of texts, token ids or a list of those."""

    @classmethod
    def parse(cls, body: dict, limits: Limits, tokenizer) -> "CompletionRequest":
        check_fields(body, COMPLETION_FIELDS, {"prompt"})
        prompt = body["prompt"]
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
            prompts = [encode_prompt(tokenizer, p) for p in ([prompt] if isinstance(prompt, str) else prompt)]
        else:
            prompts = token_prompts(prompt)
        return cls(**_openai_fields(body, limits, prompts, chat=False))


@dataclasses.dataclass(frozen=True)
class ChatCompletionRequest(OpenAIRequest):
    """POST /v1/chat/completions: messages rendered with the model's chat template (tools too: tool_calls.py)."""

    has_tools: bool  # the request had tools: a message carries tool_calls, even empty
    parse_tools: bool  # the completion's tool calls are parsed (tool_choice "auto")

    @classmethod
    def parse(cls, body: dict, limits: Limits, tokenizer, template, model: str) -> "ChatCompletionRequest":
        """`template`: the model's ChatTemplate (None: it has none, a 400 naming `model`)."""
        check_fields(body, CHAT_FIELDS, {"messages"})
        if template is None:
            raise BadRequest(f"{model} has no chat template (tokenizer_config.json): use /v1/completions")
        messages = body["messages"]
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
        rendered = []
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}].role must be a string")
            if m["role"] == "tool" and m.get("tool_call_id") is None:  # OpenAI's API requires it too
                raise BadRequest(
                    f"messages[{i}].tool_call_id is required: a tool message answers the assistant's tool call "
                    "with that id"
                )
            try:
                rendered.append(history_message(i, m))
            except BadRequest:
                raise
            except ValueError as e:
                raise BadRequest(f"messages[{i}]: {e}") from None
        tools, parse = request_tools(body)
        kwargs = optional(body, "chat_template_kwargs", {})
        if not isinstance(kwargs, dict):
            raise BadRequest("chat_template_kwargs must be an object")
        taken = sorted(set(kwargs) & {"messages", "add_generation_prompt", "tools"})
        if taken:  # the request's own fields set these
            raise BadRequest(f"chat_template_kwargs cannot set {taken}: they are the request's messages and fields")
        try:
            add = bool_field(body, "add_generation_prompt", True)
            text = template.render(rendered, add, tools=tools, **kwargs)
        except ChatTemplateError as e:
            raise BadRequest(str(e)) from None
        fields = _openai_fields(body, limits, [encode_prompt(tokenizer, text)], chat=True)
        return cls(**fields, has_tools=tools is not None, parse_tools=parse)
