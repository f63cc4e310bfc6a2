"""HTTP plumbing shared by the server's routes: reading a JSON body whatever its bytes, required and
optional fields, JSON out (never NaN), and errors in OpenAI's shape."""

import asyncio
import codecs
import functools
import json
import logging

from aiohttp import web

from rlkjax.core.checks import shown

log = logging.getLogger("serve.rollout")


class BadRequest(ValueError):
    """The client's request is wrong: 400 with the message."""


class ReadTimeout(Exception):
    """The client was too slow sending its body: 408."""


class RequestTimeout(Exception):
    """A request's own `timeout` passed before it finished (its sequences are cancelled): 408."""


class ShuttingDown(Exception):
    """The server is draining for shutdown: 503."""


class EngineFailed(Exception):
    """The engine failed the request (a step raised; logged where it happened): 500 with the reason."""


class Starting(Exception):
    """The server is still compiling its warm-up shapes: 503 with Retry-After (seconds), so a client
    or load balancer tries again later or elsewhere instead of holding a connection open for minutes."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


def check_fields(body: dict, allowed: set[str], required: set[str]) -> dict:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field(s) {shown(unknown)}; allowed: {sorted(allowed)}")
    missing = sorted(required - set(body))
    if missing:
        raise BadRequest(f"missing field(s) {missing}")
    return body


def check_context(context: int, prompt_len: int, max_tokens: int, field: str = "max_tokens") -> None:
    """A prompt and completion over the model's context: vLLM's 400s, word for word, so clients that look for
    "maximum context length" (agent frameworks ending an episode) recognise them. A completion longer than the
    whole context gets vLLM's newer wording, which names the field."""
    if max_tokens > context:
        raise BadRequest(
            f"'{field}' is too large: {shown(max_tokens)}. This model's maximum context length is {context} tokens "
            f"and your request has {prompt_len} input tokens ({shown(max_tokens)} > {context} - {prompt_len})."
        )
    if prompt_len + max_tokens > context:
        raise BadRequest(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion."
        )


def optional(body: dict, name: str, default):
    """An optional field: absent or an explicit null mean the default (as OpenAI's API reads them)."""
    value = body.get(name)
    return default if value is None else value


def token_prompts(value, name="prompt"):
    """One prompt (list of ids) or a batch (list of lists) -> list of lists."""
    if isinstance(value, list) and value and all(isinstance(p, list) for p in value):
        return value
    if isinstance(value, list):
        return [value]
    raise BadRequest(f"{name} must be a list of token ids or a list of such lists")


async def read_json(request: web.Request, read_timeout: float) -> dict:
    """The body as a JSON object, or BadRequest saying what is wrong with it: whatever the bytes
    (bad compression, an unknown charset, invalid UTF-8, nesting deep enough to exhaust the parser,
    integers longer than Python will parse) the answer is a 4xx, never a 500."""
    try:
        raw = await asyncio.wait_for(request.read(), read_timeout)
    except TimeoutError:
        raise ReadTimeout(f"the request body did not arrive within {read_timeout:g} s") from None
    except web.HTTPException:
        raise
    except Exception as e:  # e.g. a corrupt gzip/deflate body
        raise BadRequest(f"cannot read the body ({request.headers.get('Content-Encoding', 'identity')}): {e}") from None
    charset = request.charset or "utf-8"
    try:
        codecs.lookup(charset)
    except LookupError:
        raise BadRequest(f"unknown charset {shown(charset)}; send UTF-8") from None
    try:
        text = raw.decode(charset)
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not valid {charset}: {e.reason} at byte {e.start}") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and integers over Python's digit limit
        raise BadRequest(f"malformed JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def json_response(data, status: int = 200) -> web.Response:
    """JSON that is JSON: NaN or Infinity (which json.dumps writes by default, and no parser accepts)
    raise here, so a non-finite value becomes a logged 500, never a 200 with invalid JSON."""
    return web.json_response(data, status=status, dumps=functools.partial(json.dumps, allow_nan=False))


_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def error_response(status: int, message: str):
    """OpenAI's error shape, so its clients show the message (not just the status code)."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return json_response({"error": {"message": message, "type": kind, "param": None, "code": None}}, status=status)


@web.middleware
async def error_middleware(request, handler):
    try:
        return await handler(request)
    except BadRequest as e:
        return error_response(400, str(e))
    except ShuttingDown as e:
        return error_response(503, str(e))
    except Starting as e:
        response = error_response(503, str(e))
        response.headers["Retry-After"] = str(e.retry_after)
        return response
    except (ReadTimeout, RequestTimeout) as e:
        return error_response(408, str(e))
    except EngineFailed as e:
        return error_response(500, str(e))
    except web.HTTPRequestEntityTooLarge:
        return error_response(413, f"request body over the limit of {request.client_max_size} bytes")
    except web.HTTPException as e:
        return error_response(e.status, e.reason)
    except asyncio.CancelledError:
        raise
    except Exception:  # a bug of ours: logged with its traceback, answered as JSON, the server keeps serving
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal error (logged on the server)")
