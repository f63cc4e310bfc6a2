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
from rlkjax.text.chat import DEFAULT_TEMPLATE, ChatTemplate
from rlkjax.text.tokenizer import load_tokenizer
from serve.protocol import CHAT_FIELDS, COMPLETION_FIELDS
from serve.text import token_pieces
from tests.helpers import ENGINE, assert_bits_equal
from tests.server_process import metric, post_raw, start_server
from tests.tokenizer_files import make_bpe_checkpoint

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
        assert len(mine) >= 3, "20 tokens in rounds of 4 come in several chunks"
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
    # 23 tokens: prompt and completion fit the learner's 32-position program the other tests score with
    kw = dict(model=MODEL, prompt="Stop here", max_tokens=23, logprobs=1, seed=11, n=3)
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
    # logprobs 0: the two-stop-id rounds without top logprobs, as test_min_tokens_and_ignore_eos runs them
    got = oai.completions.create(**kw | {"logprobs": 0}, extra_body={"stop_token_ids": [stop_id]})
    ids1 = got.choices[1].logprobs.model_extra["token_ids"]
    assert got.choices[1].finish_reason == "stop" and ids1[-1] == stop_id and len(ids1) <= 4


def test_logprob_shapes_usage_and_token_ids(oai, server):
    """tokens join into the text, text_offset is where each starts, usage counts each prompt once,
    return_token_ids gives prompt and completion ids, and seed is reported."""
    got = oai.completions.create(  # 8 tokens: whole rounds of 4 (no one-step round of its own to compile)
        model=MODEL,
        prompt=["Grüße", "Hi"],
        max_tokens=8,
        n=2,
        logprobs=1,
        seed=3,
        extra_body={"return_token_ids": True},
    )
    assert got.usage.prompt_tokens == len("Grüße".encode()) + 2 and got.usage.completion_tokens == 4 * 8
    assert got.model_extra["seed"] == 3
    for k, c in enumerate(got.choices):
        lp = c.logprobs
        assert "".join(lp.tokens) == c.text and len(lp.tokens) == len(lp.token_logprobs) == 8
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(8)]
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
    loglikelihood (temperature 0, max_tokens 1, logprobs 1, echo): the continuation's logprobs are the
    learner's, and each position's top_logprobs (one entry, the learner's top id and bits) is what lm-eval's
    is_greedy reads; with max_tokens 0 (scoring only) the same. generate_until: greedy, stop strings, max_tokens."""
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
    whole, top_ids, top_lps = rlkjax.score(params, cfg, [context + continuation], [1], top_logprobs=1)[0]
    for max_tokens in (1, 0):
        status, out = post_raw(
            server, "/v1/completions", json.dumps(loglikelihood | {"max_tokens": max_tokens}).encode()
        )
        assert status == 200, out
        lp = out["choices"][0]["logprobs"]
        end = len(context + continuation)
        assert_bits_equal(exact(lp["token_logprobs"][1:end]), whole, "prompt and continuation")
        assert lp["top_logprobs"][0] is None and lp["top_token_ids"][1:end] == top_ids.tolist()
        assert_bits_equal(exact([list(d.values()) for d in lp["top_logprobs"][1:end]]), top_lps, "top logprobs")
        # lm-eval's is_greedy: the continuation is greedy iff each position's most likely string is its token
        greedy = all(
            max(d, key=d.get) == t
            for d, t in zip(lp["top_logprobs"][len(context) : end], lp["tokens"][len(context) : end])
        )
        assert greedy == (top_ids[len(context) - 1 :, 0].tolist() == continuation)
        assert len(lp["tokens"]) == end + max_tokens
    generate_until = {
        "prompt": [list(b"Q: say something\nA:")],
        "model": MODEL,
        "max_tokens": 32,
        "temperature": 0,
        "stop": ["\n\n", "Q:"],
        "seed": 1234,
    }
    status, out = post_raw(server, "/v1/completions", json.dumps(generate_until).encode())
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
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        oai.chat.completions.create(**kw | {"logprobs": False}, top_logprobs=3)


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
        ({"prompt": "a", "logprobs": 21}, r"logprobs must be null or an integer in \[0, 20\]"),
        ({"prompt": "a", "temperature": -1}, "temperature must be 0"),
        ({"prompt": "a", "top_k": -2}, "top_k must be"),
        ({"prompt": "a", "top_p": 0}, r"top_p must be in \(0.0, 1.0\]"),
        ({"prompt": "a", "min_p": 1.5}, "min_p must be in"),
        ({"prompt": "a", "max_tokens": 4, "min_tokens": 5}, r"min_tokens must be an integer in \[0, 4\]"),
        ({"prompt": "a", "ignore_eos": "yes"}, "ignore_eos must be true or false"),
        ({"prompt": "a", "truncated_logprobs": True, "logprobs": 2}, "truncated_logprobs cannot be combined"),
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


def learner_top_logprobs(tiny, prompt, ids, k):
    """The learner's top-k ids and logprobs (temperature 1) at each of the completion's positions."""
    cfg, params = tiny
    return rlkjax.score(params, cfg, [list(prompt) + list(ids)], [len(prompt)], top_logprobs=k)[0]


def test_greedy_is_the_argmax_with_the_learners_bits(oai, tiny):
    """temperature 0: each token is the learner's most likely one (its top id), its logprob the learner's
    temperature-1 bits, and logprobs=k gives the learner's k top logprobs with their bits; the sampled
    token's entry in top_logprobs is its token_logprobs value, bit for bit. top_k=1 at temperature 1 draws
    the same tokens (and with truncated_logprobs their renormalised logprob: 0)."""
    kw = dict(model=MODEL, prompt="Hello", max_tokens=10, logprobs=5, seed=1)
    lp = oai.completions.create(**kw, temperature=0).choices[0].logprobs
    ids = lp.model_extra["token_ids"]
    learner, top_ids, top_lps = learner_top_logprobs(tiny, b"Hello", ids, 5)
    assert ids == top_ids[:, 0].tolist(), "greedy takes the argmax"
    assert_bits_equal(exact(lp.token_logprobs), learner, "greedy logprobs vs score at T=1")
    assert lp.model_extra["top_token_ids"] == top_ids.tolist()
    for i, (t, d) in enumerate(zip(lp.tokens, lp.top_logprobs)):
        assert_bits_equal(exact([d[t]]), exact([lp.token_logprobs[i]]), f"sampled entry {i}")
        assert lp.tokens[i] == t and len(d) <= 5  # ids that decode alike share a key
    # logprobs 0, as the renormalised request below: both run one truncating round (with top logprobs
    # it would be a second; tests/test_sampling.py covers top_k with top_logprobs)
    top1 = oai.completions.create(**kw | {"logprobs": 0}, extra_body={"top_k": 1}).choices[0].logprobs
    assert top1.model_extra["token_ids"] == ids
    assert_bits_equal(exact(top1.token_logprobs), learner, "top_k 1: the full distribution's logprobs")
    renormalised = oai.completions.create(
        **kw | {"logprobs": 0}, extra_body={"top_k": 1, "truncated_logprobs": True}
    ).choices[0]
    assert renormalised.logprobs.model_extra["token_ids"] == ids and renormalised.logprobs.token_logprobs == [0.0] * 10


def test_top_p_and_min_p_draws_stay_in_the_kept_set(oai, tiny):
    """Several samples with top_p (then min_p): every drawn token is in the kept set worked out from the
    learner's top logprobs (top_p: the mass of the ids more likely than it is < top_p; min_p: p >= min_p p_max),
    and its logprob is the learner's full-distribution value."""
    for extra, k in [({"top_p": 0.02}, 20), ({"min_p": 0.9}, 1)]:
        got = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=6, n=4, seed=2, logprobs=0, extra_body=extra)
        for c in got.choices:
            ids = c.logprobs.model_extra["token_ids"]
            learner, top_ids, top_lps = learner_top_logprobs(tiny, b"Hi", ids, k)
            assert_bits_equal(exact(c.logprobs.token_logprobs), learner, f"{extra}")
            for t, lp, alt_ids, alt_lps in zip(ids, learner, top_ids, top_lps.astype(np.float64)):
                if "top_p" in extra:
                    assert t in alt_ids.tolist(), "a token kept by top_p 0.02 is among the 20 most likely"
                    assert np.exp(alt_lps[alt_lps > lp]).sum() < 0.02 * (1 + 1e-5)
                else:
                    assert lp >= alt_lps[0] + np.log(0.9) - 1e-6


def test_min_tokens_and_ignore_eos(oai):
    """A stop id drawn before min_tokens is an ordinary token (plain and streamed: the stream's last chunk
    agrees); ignore_eos keeps sampling past the tokenizer's eos (256 for the byte tokenizer), which
    otherwise ends the sample with the same tokens up to it."""
    kw = dict(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, logprobs=0)
    free = oai.completions.create(**kw).choices[0].logprobs.model_extra["token_ids"]
    stop = free[2]
    for min_tokens in (0, 3, 6):
        end = next((j + 1 for j in range(max(min_tokens - 1, 0), 12) if free[j] == stop), 12)
        extra = {"stop_token_ids": [stop], "min_tokens": min_tokens}
        got = oai.completions.create(**kw, extra_body=extra).choices[0]
        assert got.logprobs.model_extra["token_ids"] == free[:end], min_tokens
        assert got.finish_reason == ("stop" if free[end - 1] == stop else "length")
        chunks = [c.choices[0] for c in oai.completions.create(**kw, extra_body=extra, stream=True)]
        assert sum((c.logprobs.model_extra["token_ids"] for c in chunks), []) == free[:end]
        assert chunks[-1].finish_reason == got.finish_reason and [c.finish_reason for c in chunks[:-1]] == [None] * (
            len(chunks) - 1
        )
    kw = dict(model=MODEL, prompt="eos", max_tokens=40, n=8, seed=11, logprobs=0)
    endless = oai.completions.create(**kw, extra_body={"ignore_eos": True}).choices
    stopped = oai.completions.create(**kw).choices
    hits = 0
    for a, b in zip(endless, stopped):
        ids = a.logprobs.model_extra["token_ids"]
        assert a.finish_reason == "length" and len(ids) == 40
        if 256 in ids[:-1]:
            hits += 1
            cut = ids.index(256) + 1
            assert b.logprobs.model_extra["token_ids"] == ids[:cut] and b.finish_reason == "stop"
        else:
            assert b.logprobs.model_extra["token_ids"] == ids
    assert hits, "seed 11 draws the eos in some sample (the tiny model is near uniform over 512 ids)"


def test_every_door_stops_at_eos_with_the_same_completion(server, oai, tiny):
    """One request (n=8, seed 11, the prompt "eos") through /generate, /v1/completions, rlkjax.generate
    and Engine.submit: the same tokens and logprob bits, a sampled eos (256, the byte tokenizer's) ending
    a sample as its last token with finish_reason stop. /generate used to sample past the eos up to
    max_new_tokens, so a learner fed by it trained on tokens after the end."""
    cfg, params = tiny
    prompt, sampling = list(b"eos"), rlkjax.SamplingParams(n=8, max_tokens=40, seed=11)
    native = server.generate([prompt], n=8, max_tokens=40, seed=11)[0]
    doors = {"/generate": [(s["tokens"], s["logprobs"], s["finish_reason"]) for s in native]}
    choices = oai.completions.create(model=MODEL, prompt="eos", max_tokens=40, n=8, seed=11, logprobs=0).choices
    doors["/v1/completions"] = [
        (c.logprobs.model_extra["token_ids"], exact(c.logprobs.token_logprobs), c.finish_reason) for c in choices
    ]
    comps = rlkjax.generate(params, cfg, [prompt], sampling=sampling, eos_token_id=256)
    doors["generate"] = [(c.tokens, c.logprobs, c.finish_reason) for c in comps]
    engine = rlkjax.Engine(params, cfg, config=ENGINE, eos_token_id=256)  # the server's: compiled already
    req = engine.submit(prompt, sampling)
    engine.run_until_done()
    doors["Engine.submit"] = [(c.tokens, c.logprobs, c.finish_reason) for c in req.results]
    ended = [tokens for tokens, _, reason in doors["generate"] if reason == "stop"]
    assert ended and all(t[-1] == 256 and 256 not in t[:-1] for t in ended), "seed 11 draws the eos"
    for door, samples in doors.items():
        for (tokens, lps, reason), (want, want_lps, want_reason) in zip(samples, doors["generate"]):
            assert (tokens, reason) == (want, want_reason), door
            assert_bits_equal(lps, want_lps, door)


def test_chat_top_logprobs_plain_and_streamed(oai, tiny):
    """Chat top_logprobs=k: per token the learner's k top logprobs [{token, logprob, bytes}] with its bits,
    the sampled token's entry its own logprob; streamed, the same top logprobs (chat and completions)."""
    messages = [{"role": "user", "content": "Hi there"}]
    prompt = list(ChatTemplate(DEFAULT_TEMPLATE, {}).render(messages).encode())
    kw = dict(model=MODEL, messages=messages, max_tokens=10, seed=5, logprobs=True, top_logprobs=3)
    c = oai.chat.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    ids = c.model_extra["token_ids"]
    learner, top_ids, top_lps = learner_top_logprobs(tiny, prompt, ids, 3)
    assert_bits_equal(exact([[a.logprob for a in t.top_logprobs] for t in c.logprobs.content]), top_lps, "chat alts")
    for t, tok, alt_ids in zip(c.logprobs.content, ids, top_ids.tolist()):
        assert len(t.top_logprobs) == 3 and all(a.bytes == list(a.token.encode()) for a in t.top_logprobs)
        if tok in alt_ids:
            entry = t.top_logprobs[alt_ids.index(tok)]
            assert entry.token == t.token and exact([entry.logprob]).view("uint32") == exact([t.logprob]).view("uint32")
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    streamed = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in c.logprobs.content]
    # Completions, echoed, with a stop string that ends sample 0 inside an engine round (the tokens after it in
    # that round are dropped, their top logprobs with them): streamed and plain agree, one entry per token.
    kw = dict(model=MODEL, prompt="Hello", max_tokens=12, n=2, seed=9, logprobs=4, echo=True)
    free = oai.completions.create(**kw).choices[0].logprobs
    stop = next(p for p in free.tokens[len("Hello") + 3 :] if p)  # the first text of a token mid-round
    plain = oai.completions.create(**kw, stop=[stop])
    chunks = list(oai.completions.create(**kw, stop=[stop], stream=True))
    assert plain.choices[0].finish_reason == "stop" and len(plain.choices[0].logprobs.tokens) < len(free.tokens)
    for k, choice in enumerate(plain.choices):
        lp = choice.logprobs
        mine = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].index == k]
        assert sum((m.top_logprobs for m in mine), []) == lp.top_logprobs
        assert sum((m.model_extra["top_token_ids"] for m in mine), []) == lp.model_extra["top_token_ids"]
        assert lp.top_logprobs[0] is None and len(lp.top_logprobs) == len(lp.model_extra["top_token_ids"]) == len(
            lp.tokens
        )
