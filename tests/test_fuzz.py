"""Property-based fuzzing of every route of one real `python -m serve.rollout` on loopback.

Hypothesis builds mostly-valid requests with one thing wrong (a field of the wrong type, a huge,
negative, tiny or non-finite number, a long string, nested junk, an unknown or missing field), raw
garbage bytes with odd encodings, admin requests with and without the key, and GETs. The invariant,
for every answer: a 2xx whose numbers are all finite, or a 4xx with OpenAI's error shape; never a
5xx. Afterwards a fixed valid request returns the same tokens and logprob bits as before, and the
engine is idle again (no sequence left running, no KV page held).

One exception to the shape: a request that aiohttp's HTTP parser refuses before any route runs (a
Content-Encoding it cannot decode, such as br without the Brotli package) is answered by aiohttp
with a plain-text 400 and a closed connection; only the raw-bytes cases may get that.

Bounded for CI: RLKJAX_FUZZ_EXAMPLES examples (default 200, derandomized: the same ones every run)
within RLKJAX_FUZZ_SECONDS seconds of requests (default 35; examples past it send nothing), after
untimed warm-up requests that compile the shapes and sampling variants the examples use. The server
runs --numerics fast by default (its programs compile several times faster on a CPU; the HTTP layer
and the checks under test are the same); RLKJAX_FUZZ_NUMERICS=strict fuzzes the Pallas path. A
longer hunt: `RLKJAX_FUZZ_EXAMPLES=5000 RLKJAX_FUZZ_SECONDS=3600 RLKJAX_FUZZ_SEED=1 pytest -m slow
tests/test_fuzz.py` (a seed makes it explore new examples; hypothesis prints any failing one).
"""

import http.client
import json
import math
import os
import signal
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.helpers import assert_bits_equal
from tests.server_process import ADMIN, metric, start_server

pytestmark = pytest.mark.slow  # a real server process

EXAMPLES = int(os.environ.get("RLKJAX_FUZZ_EXAMPLES", "200"))
SECONDS = float(os.environ.get("RLKJAX_FUZZ_SECONDS", "35"))
SEED = os.environ.get("RLKJAX_FUZZ_SEED")
NUMERICS = os.environ.get("RLKJAX_FUZZ_NUMERICS", "fast")
VOCAB = 512  # qwen3-tiny

# ----- values -----

HUGE = 10**400  # valid JSON; too large for a float or an int64
numbers = st.one_of(
    st.integers(-3, 20),
    st.integers(),
    st.sampled_from([HUGE, -HUGE, 2**31, 2**32, 2**63, -(2**63), 2**64, 10**30]),
    st.floats(),  # NaN and +-Infinity too: json.dumps writes them, Python's parser reads them
    st.sampled_from([1e-320, -0.0, 5e-5, 1e308, -1e308]),
)
long_strings = st.integers(1_000, 100_000).map(lambda n: "a" * n)
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=20), long_strings)
junk = st.one_of(
    scalars,
    st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=8,
    ),
    st.integers(2, 300).map(lambda depth: json.loads("[" * depth + "]" * depth)),
)
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
CALCULATOR = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=20)}),
    min_size=1,
    max_size=3,
)

# Values a client would plausibly send, so that many requests succeed and exercise the engine.
PLAUSIBLE = {
    "prompt": st.one_of(token_ids, st.lists(token_ids, min_size=1, max_size=3)),
    "n": st.integers(1, 4),
    "max_new_tokens": st.integers(1, 4),
    "max_tokens": st.integers(0, 4),
    "max_completion_tokens": st.integers(1, 4),
    "temperature": st.one_of(st.just(0), st.floats(1e-4, 2.0)),
    "seed": st.one_of(st.integers(0, 2**32 - 1), st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=1)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "echo": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "return_token_ids": st.booleans(),
    "truncated_logprobs": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "timeout": st.floats(1e-3, 60.0),
    "top_k": st.integers(-1, VOCAB + 1),
    "top_p": st.floats(0.01, 1.0),
    "min_p": st.floats(0.0, 1.0),
    "min_tokens": st.integers(0, 4),
    "top_logprobs": st.integers(0, 20),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "chat_template_kwargs": st.dictionaries(st.text(max_size=8), scalars, max_size=2),
    "messages": messages,
    "model": st.text(max_size=10),
    "user": st.text(max_size=10),
    "path": st.sampled_from(["", ".", "/", "/nonexistent", "tests", "qwen3-tiny", "a" * 100_000, "\x00", "\ud800"]),
    "tools": st.one_of(st.just(CALCULATOR), st.lists(junk, max_size=2)),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "c"}}]),
    "token_ids": token_ids,
    "request_id": st.text(max_size=10),
    "sampling_params": st.fixed_dictionaries(  # vLLM's names: honoured, harmless, or refused unless neutral
        {"max_tokens": st.integers(1, 4)},
        optional={
            "n": st.integers(1, 4),
            "temperature": st.one_of(st.just(0), st.floats(1e-4, 2.0)),
            "seed": st.integers(0, 2**32 - 1),
            "logprobs": st.one_of(st.none(), st.integers(-1, 21)),
            "top_k": st.integers(-1, VOCAB + 1),
            "top_p": st.floats(0.01, 1.0),
            "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
            "skip_special_tokens": st.booleans(),
            "detokenize": st.booleans(),
            "presence_penalty": st.sampled_from([0.0, 0.5]),
            "best_of": st.integers(1, 3),
            "stop": st.one_of(st.none(), st.text(max_size=3)),
            "min_tokens": st.one_of(st.none(), junk),
        },
    ),
}
PLAUSIBLE_BY_ROUTE = {  # where a route reads a name differently
    ("/v1/completions", "prompt"): st.one_of(
        st.text(max_size=20), token_ids, st.lists(st.text(max_size=5), max_size=3)
    ),
    ("/v1/completions", "logprobs"): st.integers(0, 20),
    ("/v1/chat/completions", "logprobs"): st.booleans(),
}

# Small, fast requests: every fuzzed body starts from one of these and changes one thing.
BASES = {
    "/generate": {"prompt": [1, 2, 3], "max_new_tokens": 2, "seed": 0},
    "/v1/completions": {"prompt": "ab", "max_tokens": 2, "seed": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "seed": 0},
    "/update_weights": {"path": "/nonexistent"},
    "/inference/v1/generate": {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "seed": 0}},
}
FIELDS = {
    "/generate": ["prompt", "n", "max_new_tokens", "temperature", "seed", "stop_token_ids", "ignore_eos"],
    "/v1/completions": [
        *("prompt", "max_tokens", "temperature", "n", "seed", "stop", "stream", "stream_options", "user"),
        *("stop_token_ids", "include_stop_str_in_output", "return_token_ids", "timeout", "top_k", "top_p"),
        *("min_p", "min_tokens", "ignore_eos", "truncated_logprobs", "logprobs", "echo", "model"),
    ],
    "/update_weights": ["path"],
    "/inference/v1/generate": ["model", "token_ids", "sampling_params", "request_id", "stream", "timeout"],
}
FIELDS["/v1/chat/completions"] = [f for f in FIELDS["/v1/completions"] if f not in ("prompt", "echo")] + [
    *("messages", "top_logprobs", "max_completion_tokens", "add_generation_prompt", "chat_template_kwargs"),
    *("tools", "tool_choice"),
]
AUTH = {"Authorization": f"Bearer {ADMIN}"}
header_text = st.binary(max_size=40).map(lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7F))


@st.composite
def json_requests(draw):
    """(method, path, body bytes, headers, raw=False): a route's base body with one or a few fields set,
    removed or added."""
    route = draw(st.sampled_from(list(BASES)))
    body = dict(BASES[route])
    action = draw(st.sampled_from(["plausible", "plausible", "junk", "remove", "unknown", "several"]))
    fields = FIELDS[route]
    for _ in range(draw(st.integers(2, 4)) if action == "several" else 1):
        name = draw(st.sampled_from(fields))
        if action == "remove":
            body.pop(name, None)
        elif action == "unknown":
            body[draw(st.text(min_size=1, max_size=12))] = draw(junk)
        elif action == "junk":
            body[name] = draw(junk)
        else:
            body[name] = draw(PLAUSIBLE_BY_ROUTE.get((route, name), PLAUSIBLE.get(name, junk)))
    headers = {"Content-Type": "application/json"}
    if route == "/update_weights":
        headers |= draw(st.sampled_from([AUTH, AUTH, {}, {"Authorization": b"Bearer " + draw(header_text)}]))
    data = json.dumps(body).encode("utf-8", "surrogatepass")  # lone surrogates are valid JSON escapes
    return "POST", route, data, headers, False


@st.composite
def raw_requests(draw):
    """Garbage bytes under odd encodings and charsets, and GETs (with junk queries) of every path
    (method, path, body bytes, headers, raw=True)."""
    if draw(st.booleans()):
        path = draw(
            st.sampled_from(["/health", "/metrics", "/v1/models", "/generate", "/inference/v1/generate", "/nope", "/"])
        )
        query = draw(st.sampled_from(["", "?x=1", "?" + "a" * 5000, "?%ff%00"]))
        return draw(st.sampled_from(["GET", "GET", "POST", "PUT", "DELETE"])), path + query, None, {}, True
    route = draw(st.sampled_from(list(BASES)))
    data = draw(
        st.one_of(
            st.binary(max_size=300),
            st.just(json.dumps(BASES[route]).encode()[:-1]),  # cut short
            st.integers(500, 100_000).map(lambda depth: b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"),
        )
    )
    headers = draw(
        st.sampled_from(
            [
                {"Content-Type": "application/json"},
                {"Content-Type": "application/json", "Content-Encoding": "gzip"},
                {"Content-Type": "application/json", "Content-Encoding": "deflate"},
                {"Content-Type": "application/json", "Content-Encoding": "br"},
                {"Content-Type": "application/json; charset=utf-16"},
                {"Content-Type": "text/plain; charset=klingon"},
                {"Content-Type": "multipart/form-data"},
            ]
        )
    )
    return "POST", route, data, headers | (AUTH if route == "/update_weights" else {}), True


# ----- the invariant -----


def _no_constant(name):
    raise AssertionError(f"{name} in a response: not JSON")


def finite_json(text: str):
    """Parsed JSON whose numbers are all finite (NaN/Infinity are refused while parsing)."""
    value = json.loads(text, parse_constant=_no_constant)
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float):
            assert math.isfinite(v), v
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return value


def assert_openai_error(payload):
    error = payload["error"]
    assert isinstance(error["message"], str) and error["message"], payload
    assert isinstance(error["type"], str) and "param" in error and "code" in error, payload


def check_answer(status: int, content_type: str, data: bytes, what: str, raw: bool = False):
    """A 2xx with finite numbers, or a 4xx with OpenAI's error shape; never a 5xx. raw: the request may
    be one that aiohttp's HTTP parser refuses (a plain-text 400) before it reaches a route."""
    assert status < 500, f"{status} for {what}: {data[:500]!r}"
    text = data.decode("utf-8")
    if raw and status == 400 and content_type.startswith("text/plain"):
        return
    if status >= 400:
        assert 400 <= status < 500, (status, what)
        assert_openai_error(finite_json(text))
    elif content_type.startswith("text/event-stream"):
        for line in text.split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                event = finite_json(line[len("data: ") :])
                if "error" in event:
                    assert_openai_error(event)
    elif content_type.startswith("text/plain"):  # /metrics
        for line in text.splitlines():
            if line and not line.startswith("#"):
                assert math.isfinite(float(line.split()[-1])), line
    else:
        finite_json(text)


def send(port: int, method: str, path: str, data: bytes | None, headers: dict):
    # Generous: a first use of a variant compiles (echo with logprobs=k compiles the learner's pass per
    # k; strict numerics on a loaded CPU took over 120 s), and a hang still fails the test
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        conn.close()


# ----- the test -----

FIXED = {"prompt": [[5, 6, 7], [1, 2]], "n": 2, "max_new_tokens": 4, "temperature": 1.0, "seed": 11}


def fixed_answer(port):
    status, _, data = send(port, "POST", "/generate", json.dumps(FIXED).encode(), {"Content-Type": "application/json"})
    assert status == 200, data
    results = json.loads(data)["results"]
    return [(s["tokens"], np.asarray(s["logprobs"], np.float32)) for prompt in results for s in prompt]


WARM_UP = (
    [  # one request per compiled shape or variant the examples reach (max_tokens <= 4, n <= 4)
        ("/generate", {"prompt": [[1, 2]] * k, "n": n, "max_new_tokens": 2, "seed": 0})
        for k in (1, 2, 3)
        for n in (1, 2, 4)
    ]
    + [
        ("/v1/completions", {"prompt": "ab", "max_tokens": 2, "seed": 0} | extra)
        for extra in (
            {"top_p": 0.5},
            {"logprobs": 3},
            {"echo": True, "logprobs": 1},
            {"stop_token_ids": [3, 4]},
            {"temperature": 0},
            {"n": 4, "top_k": 5},
            {"n": 2, "logprobs": 1},
            {"max_tokens": 1},
            {"stop_token_ids": [7]},
        )
    ]
    + [("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "logprobs": 1}})]
)


@pytest.fixture(scope="module")
def server():
    proc, client = start_server("--read-timeout", "5", "--numerics", NUMERICS, "--max-batch", "4")
    port = int(client.url.rsplit(":", 1)[1])
    yield proc, port, client
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except Exception:
        proc.kill()
        proc.wait()


HUGE_FIELDS = [("/generate", f) for f in ("temperature", "n", "max_new_tokens", "seed", "stop_token_ids", "prompt")]
HUGE_FIELDS += [
    (route, f)
    for route in ("/v1/completions", "/v1/chat/completions")
    for f in ("temperature", "top_p", "min_p", "timeout", "seed", "n", "max_tokens", "top_k", "min_tokens")
]
HUGE_FIELDS += [("/v1/completions", "logprobs"), ("/v1/chat/completions", "top_logprobs")]


def check_huge_values_are_4xx_naming_the_field(port):
    """JSON integers have no size limit: +-10**400 in a numeric field used to raise OverflowError (a
    500) in the float checks, numpy's casts or asyncio's clock; a 100,000-character checkpoint path
    made is_dir raise 'File name too long'. Each is a 400 that names the field, quoting the value short."""
    cases = [
        (
            route,
            field,
            BASES[route] | {field: [1, sign * HUGE] if field in ("prompt", "stop_token_ids") else sign * HUGE},
        )
        for route, field in HUGE_FIELDS
        for sign in (1, -1)
    ]
    cases.append(("/update_weights", "path", {"path": "a" * 100_000}))
    for route, field, body in cases:
        status, content_type, data = send(port, "POST", route, json.dumps(body).encode(), AUTH)
        check_answer(status, content_type, data, f"{route} {field}")
        message = json.loads(data)["error"]["message"]
        assert status == 400 and field in message and len(message) < 500, (route, field, message)


def fuzz(port, examples: int, seconds: float) -> int:
    """Send hypothesis's requests until `examples` or `seconds` run out, checking every answer; returns
    how many were sent."""
    end, sent = time.monotonic() + seconds, [0]

    @settings(
        max_examples=examples,
        derandomize=SEED is None,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(request=st.one_of(json_requests(), json_requests(), raw_requests()))
    def one(request):
        if time.monotonic() > end:  # the time budget is spent: the remaining examples send nothing
            return
        method, path, data, headers, raw = request
        what = f"{method} {path} {headers} {(data or b'')[:300]!r}"
        check_answer(*send(port, method, path, data, headers), what, raw)
        sent[0] += 1

    if SEED is not None:
        one = seed(int(SEED))(one)
    one()
    return sent[0]


def test_no_input_gets_a_5xx_and_the_server_serves_the_same_bits_after(server):
    """Every request gets a 2xx with finite numbers or an OpenAI-shaped 4xx (huge numbers and long
    paths first, then hypothesis's); afterwards the engine is idle and a fixed request returns the
    bits it returned before. One test, so that one server serves it all (pytest-xdist would start a
    server per worker for several)."""
    proc, port, client = server
    for route, body in WARM_UP:
        assert send(port, "POST", route, json.dumps(body).encode(), {})[0] == 200, (route, body)
    before = fixed_answer(port)

    check_huge_values_are_4xx_naming_the_field(port)
    sent = fuzz(port, EXAMPLES, SECONDS)
    print(f"{sent} fuzzed requests")
    assert sent >= min(EXAMPLES, 50), f"only {sent} requests within {SECONDS} s: the budget checks too little"
    assert proc.poll() is None, "the server died"

    deadline = time.monotonic() + 60  # timed-out and cancelled requests are freed at the next engine step
    while metric(client, "rlkjax_running_sequences") or metric(client, "rlkjax_kv_pages_used"):
        assert time.monotonic() < deadline, "sequences or KV pages still held after the fuzzing stopped"
        time.sleep(0.1)
    after = fixed_answer(port)
    assert [t for t, _ in after] == [t for t, _ in before]
    for (_, a), (_, b) in zip(after, before):
        assert_bits_equal(a, b, "a fixed request's logprobs after fuzzing")
    assert "unhandled error" not in open(proc.log).read()
