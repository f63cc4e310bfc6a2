"""vLLM's token route, `POST /inference/v1/generate`: token ids in, token ids and their logprobs out, no text
on either side, the shape agent-RL frameworks drive multi-turn episodes through (each turn's prompt is the
previous turns' tokens plus what the environment appends, never re-tokenised).

Request: {"token_ids": [...], "sampling_params": {...}, "model", "request_id", "stream", "timeout"}.
Response (vLLM's GenerateResponse, plus prompt_token_ids, seed, usage and each choice's policy_version):
{"request_id", "prompt_token_ids", "choices": [{"index", "token_ids", "logprobs": {"content": [{"token":
"token_id:<id>", "logprob", "bytes": null, "top_logprobs": [...]}]} or null, "finish_reason"}],
"prompt_logprobs": null, "kv_transfer_params": null, ...}. Logprobs are the sampler's float32 values written
as the JSON doubles that convert back to the same bits (equal to `rlkjax.score` of the same tokens).

sampling_params takes vLLM's SamplingParams field names. Those the engine honours: n, max_tokens (absent:
up to the context), temperature, top_p, top_k (-1: off), min_p, seed, min_tokens, stop_token_ids,
ignore_eos, logprobs (k alternatives per token; null: no logprobs) and our truncated_logprobs. Those that
only shape text or streaming, which this route has none of, are accepted and have no effect (HARMLESS).
Those that would change the distribution or the output are accepted only at their neutral value (NEUTRAL:
penalties, logit_bias, stop strings, beam search, structured outputs, ...): another value is a 400 naming
it, never silently ignored. A name vLLM does not know either is a 400 (a typo would otherwise sample
with the default).
"""

import uuid

from rlkjax.requests import check_tokens, most_alternatives, shown
from rlkjax.sampling_params import SamplingParams
from serve.http import BadRequest, _fields, _json, _json_response, _opt, check_context
from serve.openai_params import _timeout

FIELDS = {
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


def _check_fields(sp: dict) -> None:
    unknown = sorted(set(sp) - HONOURED - HARMLESS - set(NEUTRAL))
    if unknown:
        raise BadRequest(f"unknown sampling_params field(s) {shown(unknown)}: not fields of vLLM's SamplingParams")
    for name, neutral in NEUTRAL.items():
        value = sp.get(name)
        if name == "best_of" and value == _opt(sp, "n", 1) and not isinstance(value, bool):
            continue
        if not _unset(value, neutral):
            raise BadRequest(
                f"sampling_params.{name}={shown(value)} is not supported by this server (only "
                f"{'null' if neutral is None else neutral}): it would change what is sampled or returned"
            )


def sampling_params(server, sp: dict, prompt_len: int) -> tuple[SamplingParams, bool]:
    """(the engine's SamplingParams, whether logprobs were asked for), checked; BadRequest names the field."""
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be an object")
    _check_fields(sp)
    logprobs = sp.get("logprobs")
    most = most_alternatives(server.cfg.vocab_size)
    if logprobs is not None and (
        not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= most
    ):
        raise BadRequest(f"sampling_params.logprobs must be null or an integer in [0, {most}], got {shown(logprobs)}")
    max_tokens = _opt(sp, "max_tokens", max(server.engine.max_context - prompt_len, 1))  # vLLM: up to the context
    top_k = _opt(sp, "top_k", 0)
    try:
        params = SamplingParams(
            n=_opt(sp, "n", 1),
            max_tokens=max_tokens,
            temperature=_opt(sp, "temperature", 1.0),
            stop_token_ids=_opt(sp, "stop_token_ids", []),
            min_tokens=_opt(sp, "min_tokens", 0),
            ignore_eos=_opt(sp, "ignore_eos", False),
            top_logprobs=logprobs or 0,
            top_k=0 if top_k == -1 and not isinstance(top_k, bool) else top_k,
            top_p=_opt(sp, "top_p", 1.0),
            min_p=_opt(sp, "min_p", 0.0),
            truncated_logprobs=_opt(sp, "truncated_logprobs", False),
        )
    except ValueError as e:
        raise BadRequest(f"sampling_params: {e}") from None
    check_context(server.engine.max_context, prompt_len, params.max_tokens, "sampling_params.max_tokens")
    return params, logprobs is not None


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
    request_id = _opt(body, "request_id", uuid.uuid4().hex)
    if not isinstance(request_id, str) or not 0 < len(request_id) <= 256:
        raise BadRequest(f"request_id must be a string of 1 to 256 characters, got {shown(request_id)}")
    return request_id, _timeout(_opt(body, "timeout", None))


def _logprobs(c) -> dict:
    """vLLM's chat-shaped logprobs with tokens named by id ("token_id:<id>")."""
    tops = [None] * len(c.tokens) if c.top_ids is None else zip(c.top_ids.tolist(), c.top_logprobs.tolist())
    content = []
    for t, lp, top in zip(c.tokens, c.logprobs.tolist(), tops):
        alts = [] if top is None else [{"token": f"token_id:{i}", "logprob": a, "bytes": None} for i, a in zip(*top)]
        content.append({"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": alts})
    return {"content": content}


async def generate(server, request):
    body = _fields(await _json(request, server.config.read_timeout), FIELDS, {"token_ids", "sampling_params"})
    try:
        tokens = check_tokens("token_ids", body["token_ids"], server.cfg.vocab_size)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    request_id, timeout = _request_fields(body)
    sp = body["sampling_params"]
    params, want_logprobs = sampling_params(server, sp, len(tokens))
    seeds, seed = server.seeds({"seed": sp.get("seed")}, 1, params.n)
    requests = await server.wait(server.submit([tokens], params, seeds), timeout)
    results = requests[0].results
    choices = [
        {
            "index": j,
            "token_ids": c.tokens,
            "logprobs": _logprobs(c) if want_logprobs else None,
            "finish_reason": c.finish_reason,
            "policy_version": c.policy_version,
        }
        for j, c in enumerate(results)
    ]
    prompt, completion = len(tokens), sum(len(c.tokens) for c in results)
    return _json_response(
        {
            "request_id": request_id,
            "prompt_token_ids": tokens,
            "choices": choices,
            "prompt_logprobs": None,
            "kv_transfer_params": None,
            "seed": seed,
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        }
    )
