"""The OpenAI-compatible routes through the official `openai` client (sync and async) against a real
`python -m serve.rollout` on loopback: streaming, stop strings, logprob shapes, echo with the learner's
prompt logprobs, chat, timeouts and disconnects that free KV pages, the request bodies lm-eval-harness's
`local-completions` sends, and vLLM-style online batch invariance (a prompt's logprobs alone and among 32
concurrent requests are the same bits, and those of `rlkjax.score`)."""

import asyncio
import json
import socket
import time

import numpy as np
import openai
import pytest

import rlkjax
from rlkjax.tokenizer import load_tokenizer
from serve.chat import DEFAULT_TEMPLATE, ChatTemplate
from serve.openai_api import CHAT_FIELDS, COMPLETION_FIELDS
from serve.text import token_pieces
from tests.conftest import assert_bits_equal
from tests.test_openai_text import make_bpe_checkpoint
from tests.test_server import metric, post_raw, start_server

pytestmark = pytest.mark.slow  # a real server process (its first requests compile)

MODEL = "qwen3-tiny"


@pytest.fixture(scope="module")
def server():
    proc, client = start_server()
    yield client
    proc.terminate()
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def exact(values) -> np.ndarray:
    """JSON doubles back to the float32 values the sampler wrote (exact: each is a float32)."""
    return np.asarray(values, np.float64).astype(np.float32)


def scored(tiny, prompt, tokens, temperature=1.0):
    cfg, params = tiny
    return rlkjax.score(params, cfg, [list(prompt) + list(tokens)], [len(prompt)], temperature=temperature)[0]


def test_stream_matches_the_plain_response_and_the_learner(oai, tiny):
    """stream=true: several chunks (one per engine round), text that joins into the plain response's text,
    the same tokens and logprob bits (equal to rlkjax.score), usage last when asked, then [DONE]."""
    kw = dict(model=MODEL, prompt="Hello", max_tokens=20, logprobs=1, seed=7, n=2)
    plain = oai.completions.create(**kw)
    chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()
    assert plain.usage.prompt_tokens == 5  # the prompt counted once for its 2 samples
    for k, choice in enumerate(plain.choices):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == k]
        assert len(mine) >= 3, "20 tokens in rounds of 8 come in several chunks"
        assert "".join(c.text for c in mine) == choice.text and mine[-1].finish_reason == choice.finish_reason
        ids = [t for c in mine for t in c.logprobs.model_extra["token_ids"]]
        lps = [lp for c in mine for lp in c.logprobs.token_logprobs]
        assert ids == choice.logprobs.model_extra["token_ids"]
        assert [o for c in mine for o in c.logprobs.text_offset] == choice.logprobs.text_offset
        assert_bits_equal(exact(lps), exact(choice.logprobs.token_logprobs), "stream vs plain")
        assert_bits_equal(exact(lps), scored(tiny, b"Hello", ids), "stream vs learner")


def test_async_streams_32_at_once(server, tiny):
    """32 concurrent streaming requests through the async client: each one's text and logprob bits equal
    the same request sent alone (and rlkjax.score)."""

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)

        async def one(i):
            stream = await client.completions.create(
                model=MODEL, prompt=f"request {i}", max_tokens=6, logprobs=0, seed=i, stream=True
            )
            text, ids, lps = "", [], []
            async for chunk in stream:
                c = chunk.choices[0]
                text += c.text
                ids += c.logprobs.model_extra["token_ids"]
                lps += c.logprobs.token_logprobs
            return text, ids, lps

        together = await asyncio.gather(*[one(i) for i in range(32)])
        alone = [await one(i) for i in (0, 31)]
        await client.close()
        return together, alone

    together, alone = asyncio.run(run())
    assert [together[0], together[31]] == alone
    for i, (_, ids, lps) in enumerate(together):
        assert len(ids) == 6
        assert_bits_equal(exact(lps), scored(tiny, f"request {i}".encode(), ids), f"request {i}")


def test_a_stream_whose_client_leaves_frees_its_pages(server):
    """A streaming client that reads a few events and disconnects: its sequences are cancelled and their
    KV pages freed (pages read from /metrics before, during and after); the engine stops generating."""
    assert metric(server, "rlkjax_kv_pages_used") == 0
    body = json.dumps({"prompt": "x" * 40, "n": 4, "max_tokens": 200, "seed": 1, "stream": True}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while received.count(b"data: ") < 2:  # the stream has started
            received += sock.recv(65536)
        assert b"text/event-stream" in received
        during = metric(server, "rlkjax_kv_pages_used")
    deadline = time.time() + 60
    while metric(server, "rlkjax_kv_pages_used") > 0:
        assert time.time() < deadline, "pages still held a minute after the client left"
        time.sleep(0.1)
    generated = metric(server, "rlkjax_generated_tokens_total")
    time.sleep(1.0)
    assert during > 0 and metric(server, "rlkjax_generated_tokens_total") == generated, "still generating for nobody"


def test_stop_strings_stop_one_sample_and_not_the_others(oai, tiny):
    """A stop string taken from sample 0's own text: sample 0 ends there (finish_reason stop, the string cut
    from its text, or kept with include_stop_str_in_output), its tokens a prefix of the unstopped run with
    the same logprob bits; samples 1 and 2 are unchanged. stop_token_ids too."""
    kw = dict(model=MODEL, prompt="Stop here", max_tokens=24, logprobs=1, seed=11, n=3)
    free = oai.completions.create(**kw)
    text0 = free.choices[0].text
    stop = next(text0[i : i + 2] for i in range(3, len(text0) - 1) if "\ufffd" not in text0[i : i + 2])
    for include in (True, False):
        extra = {"include_stop_str_in_output": include}
        got = oai.completions.create(**kw, stop=[stop, "never seen \u2603"], extra_body=extra)
        c0 = got.choices[0]
        cut = text0.index(stop) + (len(stop) if include else 0)
        assert c0.finish_reason == "stop" and c0.text == text0[:cut] == "".join(c0.logprobs.tokens)
        ids0 = c0.logprobs.model_extra["token_ids"]
        assert ids0 == free.choices[0].logprobs.model_extra["token_ids"][: len(ids0)]
        assert_bits_equal(exact(c0.logprobs.token_logprobs), scored(tiny, b"Stop here", ids0), "stopped")
        for k in (1, 2):
            if stop not in free.choices[k].text:
                assert got.choices[k].text == free.choices[k].text
                assert got.choices[k].finish_reason == free.choices[k].finish_reason
    # Streamed (stop string excluded, as in the last `got`): the same texts, and sample 0's last chunk
    # (finish_reason stop) comes in the round it stopped, before the other samples end.
    chunks = [c.choices[0] for c in oai.completions.create(**kw, stop=[stop], stream=True)]
    for k in range(3):
        assert "".join(c.text for c in chunks if c.index == k) == got.choices[k].text
    ends = {c.index: i for i, c in enumerate(chunks) if c.finish_reason}
    assert chunks[ends[0]].finish_reason == "stop" and len(got.choices[0].logprobs.tokens) < 17
    assert ends[0] < max(ends[1], ends[2])
    stop_id = free.choices[1].logprobs.model_extra["token_ids"][3]
    got = oai.completions.create(**kw, extra_body={"stop_token_ids": [stop_id]})
    ids1 = got.choices[1].logprobs.model_extra["token_ids"]
    assert got.choices[1].finish_reason == "stop" and ids1[-1] == stop_id and len(ids1) <= 4


def test_logprob_shapes_usage_and_token_ids(oai, server):
    """tokens join into the text, text_offset is where each starts, usage counts each prompt once,
    return_token_ids gives prompt and completion ids, and seed is reported."""
    got = oai.completions.create(
        model=MODEL,
        prompt=["Grüße", "Hi"],
        max_tokens=9,
        n=2,
        logprobs=1,
        seed=3,
        extra_body={"return_token_ids": True},
    )
    assert got.usage.prompt_tokens == len("Grüße".encode()) + 2 and got.usage.completion_tokens == 4 * 9
    assert got.model_extra["seed"] == 3
    for k, c in enumerate(got.choices):
        lp = c.logprobs
        assert "".join(lp.tokens) == c.text and len(lp.tokens) == len(lp.token_logprobs) == 9
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(9)]
        assert c.model_extra["prompt_token_ids"] == list(("Grüße" if k < 2 else "Hi").encode())
        assert c.model_extra["token_ids"] == lp.model_extra["token_ids"]


def test_echo_returns_the_learners_prompt_logprobs(oai, tiny):
    """echo + logprobs, max_tokens 0 and 1: the prompt's tokens, their logprobs from rlkjax.score on the
    served weights (first token null), text and offsets over prompt + completion."""
    cfg, params = tiny
    prompt = "The quick brown fox"
    ids = list(prompt.encode())
    learner = rlkjax.score(params, cfg, [ids], [1])[0]
    for max_tokens in (0, 1):
        got = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1, seed=1)
        lp = got.choices[0].logprobs
        assert lp.token_logprobs[0] is None and lp.tokens[: len(ids)] == list(prompt)
        assert_bits_equal(exact(lp.token_logprobs[1 : len(ids)]), learner, f"echo, max_tokens {max_tokens}")
        assert got.choices[0].text.startswith(prompt) and len(lp.tokens) == len(ids) + max_tokens
        assert lp.text_offset[len(ids) - 1] == len(prompt) - 1 and "".join(lp.tokens) == got.choices[0].text
    kw = dict(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    streamed = list(oai.completions.create(**kw, stream=True))
    batch = oai.completions.create(**kw | {"prompt": ["Hi", prompt, "longer " * 5]})  # scored in one batch
    assert_bits_equal(exact(batch.choices[1].logprobs.token_logprobs[1:]), learner, "echo, batched")
    assert streamed[0].choices[0].text == prompt and streamed[-1].choices[0].finish_reason == "length"


def test_lm_eval_harness_bodies(server, tiny):
    """The exact bodies lm-eval-harness 0.4's `local-completions` sends (tokenized prompts, seed 1234).
    loglikelihood asks temperature 0 with max_tokens 1: refused with a message naming greedy until greedy
    decoding is served; with max_tokens 0 (scoring only) it is answered, and the context's continuation
    logprobs are the learner's. generate_until: stop strings and max_tokens."""
    cfg, params = tiny
    context, continuation = list(b"Question: 2+2=? Answer:"), list(b" 4")
    loglikelihood = {
        "model": MODEL,
        "prompt": [context + continuation],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    status, out = post_raw(server, "/v1/completions", json.dumps(loglikelihood).encode())
    assert status == 400 and "temperature 0 (greedy decoding) is not served yet" in out["error"]["message"]
    status, out = post_raw(server, "/v1/completions", json.dumps(loglikelihood | {"max_tokens": 0}).encode())
    assert status == 200
    token_logprobs = out["choices"][0]["logprobs"]["token_logprobs"]
    whole = rlkjax.score(params, cfg, [context + continuation], [len(context)])[0]
    assert_bits_equal(exact(token_logprobs[len(context) :]), whole, "continuation")
    generate_until = {
        "prompt": [list(b"Q: say something\nA:")],
        "model": MODEL,
        "max_tokens": 32,
        "temperature": 0,
        "stop": ["\n\n", "Q:"],
        "seed": 1234,
    }
    status, out = post_raw(server, "/v1/completions", json.dumps(generate_until).encode())
    assert status == 400 and "greedy" in out["error"]["message"]
    status, out = post_raw(server, "/v1/completions", json.dumps(generate_until | {"temperature": 1.0}).encode())
    text = out["choices"][0]["text"]
    assert status == 200 and "\n\n" not in text and "Q:" not in text
    assert out["choices"][0]["finish_reason"] in ("stop", "length") and out["usage"]["completion_tokens"] <= 32


def test_chat_completions(oai, tiny):
    """/v1/chat/completions with the tiny model's documented default (ChatML) template: the prompt ids are
    the rendered template's, logprobs in chat shape equal rlkjax.score, and the stream gives the same text."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt = list(ChatTemplate(DEFAULT_TEMPLATE, {}).render(messages).encode())
    kw = dict(model=MODEL, messages=messages, max_tokens=10, seed=5, logprobs=True)
    got = oai.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    c = got.choices[0]
    assert c.message.role == "assistant" and c.model_extra["prompt_token_ids"] == prompt
    ids = c.model_extra["token_ids"]
    assert "".join(t.token for t in c.logprobs.content) == c.message.content and got.usage.prompt_tokens == len(prompt)
    assert_bits_equal(exact([t.logprob for t in c.logprobs.content]), scored(tiny, prompt, ids), "chat")
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content
    assert chunks[-1].choices[0].finish_reason == c.finish_reason
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        oai.chat.completions.create(**kw, top_logprobs=3)


def test_chat_with_a_checkpoints_tokenizer_and_template(tmp_path, tiny):
    """A checkpoint's own tokenizer.json (a byte-level BPE, Qwen's family) and the chat template in its
    tokenizer_config.json: the prompt ids are HF's rendering encoded without special tokens (the template's
    eos_token becomes its id), the token strings join into the text, streamed and plain text agree, and the
    logprobs are the learner's."""
    tok = load_tokenizer(make_bpe_checkpoint(tmp_path))
    proc, client = start_server("--tokenizer", str(tmp_path))
    try:
        oc = openai.OpenAI(base_url=client.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        messages = [{"role": "user", "content": "grüß dich"}]
        prompt = tok.encode('user: "grüß dich"\n') + [tok.eos_token_id]
        kw = dict(model=MODEL, messages=messages, max_tokens=12, seed=4, logprobs=True)
        got = oc.chat.completions.create(**kw, extra_body={"return_token_ids": True})
        c = got.choices[0]
        assert c.model_extra["prompt_token_ids"] == prompt and tok.eos_token_id == 0
        ids = c.model_extra["token_ids"]
        text = "".join(token_pieces(tok, ids, prompt))
        assert "".join(t.token for t in c.logprobs.content) == c.message.content == text
        assert_bits_equal(exact([t.logprob for t in c.logprobs.content]), scored(tiny, prompt, ids), "chat, BPE")
        chunks = list(oc.chat.completions.create(**kw, stream=True, extra_body={"return_token_ids": True}))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content
        assert sum((ch.choices[0].model_extra.get("token_ids", []) for ch in chunks), []) == ids
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_request_timeout_cancels_it_and_frees_its_pages(server, oai):
    """The `timeout` extension: a request still running after it gets 408 and its pages are freed. (10 ms:
    250 tokens take at least 32 engine rounds, which no machine runs in that time; 0.5 s was sometimes enough.)"""
    kw = dict(model=MODEL, prompt="slow", max_tokens=250, n=4, seed=1, extra_body={"timeout": 0.01})
    with pytest.raises(openai.APIStatusError) as e:
        oai.completions.create(**kw)
    assert e.value.status_code == 408 and "timeout of 0.01 s" in str(e.value)
    stream = oai.completions.create(**kw, stream=True)  # the same as an error event, after the chunks so far
    with pytest.raises(openai.APIError, match="timeout of 0.01 s"):
        list(stream)
    deadline = time.time() + 60
    while metric(server, "rlkjax_kv_pages_used") > 0:
        assert time.time() < deadline, "pages still held after the timeout"
        time.sleep(0.1)


def test_null_means_default_for_every_optional_field(server):
    """RL stacks send explicit nulls for what they leave unset: every optional field accepts null."""
    completion = {"prompt": "Hi"} | {f: None for f in COMPLETION_FIELDS - {"prompt"}}
    chat = {"messages": [{"role": "user", "content": "Hi"}]} | {f: None for f in CHAT_FIELDS - {"messages"}}
    for path, body in [("/v1/completions", completion), ("/v1/chat/completions", chat | {"max_tokens": 4})]:
        status, out = post_raw(server, path, json.dumps(body).encode())
        assert status == 200 and len(out["choices"]) == 1 and out["usage"]["completion_tokens"] <= 16, out


@pytest.mark.parametrize(
    "body,match",
    [
        ({"prompt": "a", "logprobs": 5}, "top alternatives"),
        ({"prompt": "a", "max_tokens": 0}, "only allowed with echo"),
        ({"prompt": "a", "stop": [""]}, "stop must be"),
        ({"prompt": "a", "stop": ["x"] * 33}, "at most 32 strings"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "only allowed with stream"),
        ({"prompt": "a", "timeout": -1}, "timeout must be"),
        ({"prompt": "a", "best_of": 2}, "unknown field"),
        ({"prompt": "a", "n": 0}, "n must be"),
    ],
)
def test_refused_fields_name_the_problem(oai, body, match):
    extra = {k: v for k, v in body.items() if k != "prompt"}
    with pytest.raises(openai.BadRequestError, match=match):
        oai.completions.create(model=MODEL, prompt=body["prompt"], extra_body=extra)


def test_online_batch_invariance(server, tiny):
    """vLLM's online batch-invariance test, with bits: one prompt's logprobs over /v1/completions alone,
    then among 32 concurrent requests of other prompts and lengths, are the same bits, equal to rlkjax.score."""
    probe = dict(model=MODEL, prompt="batch invariance probe", max_tokens=8, logprobs=1, seed=99)

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        alone = await client.completions.create(**probe)
        others = [
            client.completions.create(model=MODEL, prompt="z" * (i + 1), max_tokens=1 + i % 9, seed=i)
            for i in range(31)
        ]
        crowd = await asyncio.gather(client.completions.create(**probe), *others)
        await client.close()
        return alone, crowd[0]

    alone, crowded = asyncio.run(run())
    ids = alone.choices[0].logprobs.model_extra["token_ids"]
    assert crowded.choices[0].logprobs.model_extra["token_ids"] == ids
    a, b = exact(alone.choices[0].logprobs.token_logprobs), exact(crowded.choices[0].logprobs.token_logprobs)
    assert_bits_equal(a, b, "alone vs among 32")
    assert_bits_equal(a, scored(tiny, b"batch invariance probe", ids), "vs the learner")
