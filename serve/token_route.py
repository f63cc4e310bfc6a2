"""The token-id routes: our `POST /generate` and vLLM's `POST /inference/v1/generate`. Token ids in, token
ids and their logprobs out, no text on either side: the shape a learner and agent-RL frameworks drive
episodes through (each turn's prompt is the previous turns' tokens plus what the environment appends,
never re-tokenised). The bodies are read by serve.protocol; the engine is reached through the client.

/generate: {"prompt": ids or a list of them, "n", "max_new_tokens", "temperature", "seed",
"stop_token_ids", "ignore_eos"} -> {"seed", "results": [per prompt [per sample {"tokens", "logprobs",
"finish_reason", "policy_version", ...}]]}.

/inference/v1/generate: {"token_ids": [...], "sampling_params": {...}, "model", "request_id", "stream",
"timeout"}. Response (vLLM's GenerateResponse, plus prompt_token_ids, seed, usage and each choice's
policy_version): {"request_id", "prompt_token_ids", "choices": [{"index", "token_ids", "logprobs":
{"content": [{"token": "token_id:<id>", "logprob", "bytes": null, "top_logprobs": [...]}]} or null,
"finish_reason"}], "prompt_logprobs": null, "kv_transfer_params": null, ...}. Logprobs are the sampler's
float32 values written as the JSON doubles that convert back to the same bits (equal to `rlkjax.score` of
the same tokens).

sampling_params takes vLLM's SamplingParams field names. Those the engine honours: n, max_tokens (absent:
up to the context), temperature, top_p, top_k (-1: off), min_p, seed, min_tokens, stop_token_ids,
ignore_eos, logprobs (k top logprobs per token; null: no logprobs) and our truncated_logprobs. Those that
only shape text or streaming, which this route has none of, are accepted and have no effect (HARMLESS).
Those that would change the distribution or the output are accepted only at their neutral value (NEUTRAL:
penalties, logit_bias, stop strings, beam search, structured outputs, ...): another value is a 400 naming
it, never silently ignored. A name vLLM does not know either is a 400 (a typo would otherwise sample
with the default).
"""

import dataclasses

from aiohttp import web

from serve.config import ServerConfig
from serve.engine_client import EngineClient
from serve.http import json_response, read_json
from serve.protocol import GenerateRequest, TokenGenerateRequest


async def generate(client: EngineClient, config: ServerConfig, request: web.Request):
    """POST /generate."""
    req = GenerateRequest.parse(await read_json(request, config.read_timeout), client.limits)
    prompts = [list(p) for p in req.prompts]
    submission = client.submit(
        prompts, req.to_sampling_params(), list(req.seeds), max_tokens_name=GenerateRequest.MAX_TOKENS
    )
    requests = await client.wait(submission)
    results = [[dataclasses.asdict(c) | {"logprobs": c.logprobs.tolist()} for c in r.results] for r in requests]
    return json_response({"seed": req.seed, "results": results})


def _logprobs(c) -> dict:
    """vLLM's chat-shaped logprobs with tokens named by id ("token_id:<id>")."""
    tops = [None] * len(c.tokens) if c.top_ids is None else zip(c.top_ids.tolist(), c.top_logprobs.tolist())
    content = []
    for t, lp, top in zip(c.tokens, c.logprobs.tolist(), tops):
        alts = [] if top is None else [{"token": f"token_id:{i}", "logprob": a, "bytes": None} for i, a in zip(*top)]
        content.append({"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": alts})
    return {"content": content}


async def generate_tokens(client: EngineClient, config: ServerConfig, request: web.Request):
    """POST /inference/v1/generate."""
    req = TokenGenerateRequest.parse(await read_json(request, config.read_timeout), client.limits)
    tokens = list(req.token_ids)
    submission = client.submit([tokens], req.to_sampling_params(), list(req.seeds))
    results = (await client.wait(submission, req.timeout))[0].results
    choices = [
        {
            "index": j,
            "token_ids": c.tokens,
            "logprobs": _logprobs(c) if req.logprobs else None,
            "finish_reason": c.finish_reason,
            "policy_version": c.policy_version,
        }
        for j, c in enumerate(results)
    ]
    prompt, completion = len(tokens), sum(len(c.tokens) for c in results)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return json_response(
        {
            "request_id": req.request_id,
            "prompt_token_ids": tokens,
            "choices": choices,
            "prompt_logprobs": None,
            "kv_transfer_params": None,
            "seed": req.seed,
            "usage": usage,
        }
    )
