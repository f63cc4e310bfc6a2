"""vLLM's interface for agent-RL frameworks, against a real `python -m serve.rollout` on loopback serving
qwen3-tiny with Qwen3's real chat template (tests/tokenizer_files.py: its added tokens over a BPE small
enough for the tiny vocabulary): tools rendered and tool calls parsed on /v1/chat/completions, tool-call
history accepted, the token route /inference/v1/generate (its shape, its logprobs the bits of
`rlkjax.score`, a multi-turn episode appended token by token), vLLM's sampling fields accepted or refused,
the context-length 400 in vLLM's words on every route, and max_model_len on /v1/models. A second server's
model writes tool calls (tests/tool_caller.py): parsed streamed and not, through the official `openai` client."""

import json
import re
import urllib.request

import numpy as np
import openai
import pytest

import rlkjax
from rlkjax.rl.tools import Tools, tool_turn
from rlkjax.text.chat import ChatTemplate, load_chat_template
from rlkjax.text.qwen_tokenizer import QWEN3_CHAT_TEMPLATE
from rlkjax.text.tokenizer import load_tokenizer
from serve.tool_calls import tool_message
from tests.helpers import ENGINE, assert_bits_equal
from tests.server_process import post_raw, start_server
from tests.tokenizer_files import make_qwen3_template_checkpoint
from tests.tool_caller import make_tool_caller

pytestmark = pytest.mark.slow  # a real server process

CONTEXT = ENGINE.max_context
TOOLS = Tools().schemas()
USER = [{"role": "user", "content": "What is 6 times 7?"}]
CALL = {"id": "call-1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}}
HISTORY = [*USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}]
HISTORY += [{"role": "tool", "tool_call_id": "call-1", "content": "42"}]
SAMPLED_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(client, tokenizer, template): the tokenizer trained on the conversations these tests render."""
    directory = tmp_path_factory.mktemp("qwen3_template")
    template = ChatTemplate(QWEN3_CHAT_TEMPLATE, {})
    prompt = template.render(USER, tools=TOOLS)
    samples = [prompt, prompt + SAMPLED_CALL + "<|im_end|>" + tool_turn(template, ["42"])]
    samples += ["Error: the tool call is not valid JSON 0123456789"]
    tok = load_tokenizer(make_qwen3_template_checkpoint(directory, samples))
    proc, client = start_server("--tokenizer", str(directory))
    yield client, tok, load_chat_template(tok)
    proc.terminate()
    proc.wait(timeout=60)


def exact(values) -> np.ndarray:
    return np.asarray(values, np.float64).astype(np.float32)


def test_tools_are_rendered_and_tool_calls_parsed(served):
    """The prompt is the template's rendering with the tools (their schemas in Qwen3's system turn); a
    completion without a <tool_call> comes back as text with no calls. The route's response builder on a
    sampled completion followed by a call: the call in message.tool_calls, the text around it as content."""
    client, tok, template = served
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 6, "seed": 5, "return_token_ids": True}
    status, out = post_raw(client, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, out
    choice = out["choices"][0]
    prompt = template.render(USER, tools=TOOLS)
    assert "# Tools" in prompt and '"name": "calculator"' in prompt
    assert choice["prompt_token_ids"] == tok.encode(prompt)
    sampled = tok.decode(choice["token_ids"])
    assert "<tool_call>" not in sampled  # random weights: no call
    assert choice["message"] == {"role": "assistant", "content": sampled, "tool_calls": []}
    assert choice["finish_reason"] in ("length", "stop")

    message, called = tool_message(sampled + "\n" + SAMPLED_CALL + "\n" + SAMPLED_CALL.replace("6*7", "1+1"))
    assert called and message["content"] == (sampled.rstrip() or None)  # the newline before the call dropped
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "calculator", "arguments": '{"expression": "6*7"}'},
        {"name": "calculator", "arguments": '{"expression": "1+1"}'},
    ]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in message["tool_calls"])
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    assert tool_message(SAMPLED_CALL)[0]["content"] is None
    broken = sampled + "<tool_call>\nnot json\n</tool_call>"  # as vLLM: the whole text, no calls
    assert tool_message(broken) == ({"role": "assistant", "content": broken, "tool_calls": []}, False)


def test_tool_call_history_is_accepted(served):
    """An assistant turn with tool_calls and no content (absent, null or ""), then the tool's result: rendered
    as Qwen3 renders them (the call as <tool_call> JSON, the result in <tool_response>)."""
    client, tok, template = served
    expected = template.render(USER, tools=TOOLS) + SAMPLED_CALL + "<|im_end|>" + tool_turn(template, ["42"])
    for content in ({"content": None}, {}, {"content": ""}):
        history = [HISTORY[0], {"role": "assistant", "tool_calls": [CALL], **content}, HISTORY[2]]
        body = {"messages": history, "tools": TOOLS, "max_tokens": 2, "seed": 1, "return_token_ids": True}
        status, out = post_raw(client, "/v1/chat/completions", json.dumps(body).encode())
        assert status == 200, out
        assert out["choices"][0]["prompt_token_ids"] == tok.encode(expected)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"tool_choice": "required"}, "needs constrained decoding"),
        ({"tool_choice": {"type": "function", "function": {"name": "calculator"}}}, "needs constrained decoding"),
        ({"tool_choice": "sometimes"}, 'tool_choice must be "auto" or "none"'),
        ({"tools": None, "tool_choice": "auto"}, 'tool_choice "auto" needs tools'),
        ({"tools": [{"type": "function"}]}, r"tools\[0\] must be"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, r"tools\[0\].function.name"),
        ({"messages": [{"role": "assistant", "tool_calls": {}}]}, r"messages\[0\].tool_calls must be a list"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [CALL | {"function": {"name": "f", "arguments": "{"}}]}]},
            "arguments are not valid JSON",
        ),
        ({"messages": [{"role": "tool", "content": "4", "tool_call_id": 7}]}, "tool_call_id must be a string"),
    ],
)
def test_tool_requests_that_cannot_be_honoured_are_400(served, change, match):
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 2} | change
    status, out = post_raw(served[0], "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, out
    assert re.search(match, out["error"]["message"]), out


def test_tool_choice_none_streams_the_raw_text(served):
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 3, "seed": 2}
    status, out = post_raw(served[0], "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200 and out["choices"][0]["message"]["tool_calls"] == [], out


def test_a_stream_with_tools_and_no_call_is_the_plain_text(served):
    """Random weights write no call: streamed with tools (tool_choice auto), the content is the unstreamed
    text, no tool_calls delta, the same finish_reason and logprob bits."""
    oai = openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=600)
    kw = dict(model="m", messages=USER, tools=TOOLS, max_tokens=9, seed=4, logprobs=True)
    plain = oai.chat.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in oai.chat.completions.create(**kw, stream=True)]
    assert plain.message.tool_calls == [] and plain.finish_reason in ("length", "stop")
    assert "".join(c.delta.content or "" for c in chunks) == plain.message.content
    assert not any(c.delta.tool_calls for c in chunks) and chunks[-1].finish_reason == plain.finish_reason
    streamed = [t.logprob for c in chunks if c.logprobs for t in c.logprobs.content]
    assert_bits_equal(exact(streamed), exact([t.logprob for t in plain.logprobs.content]), "stream vs plain")


def generate(client, token_ids, **sampling):
    body = {"model": "qwen3-tiny", "token_ids": token_ids, "sampling_params": sampling}
    return post_raw(client, "/inference/v1/generate", json.dumps(body).encode())


def test_token_route_shape_bits_and_a_multi_turn_episode(served, tiny):
    """Two turns of one episode through the token route: turn 2's prompt is turn 1's prompt, its sampled
    tokens and the tool turn's tokens. vLLM's response shape (ids named "token_id:<id>"); every logprob, of
    both turns, is the bits `rlkjax.score` gives the whole episode at that position. vLLM's fields that only
    shape text are accepted."""
    client, tok, template = served
    cfg, params = tiny
    prompt = tok.encode(template.render(USER, tools=TOOLS))
    harmless = dict(skip_special_tokens=False, spaces_between_special_tokens=True, detokenize=False, top_k=-1)
    status, first = generate(client, prompt, temperature=1.0, max_tokens=5, logprobs=1, seed=3, n=2, **harmless)
    assert status == 200, first
    assert set(first) >= {"request_id", "prompt_token_ids", "choices", "prompt_logprobs", "kv_transfer_params"}
    assert first["prompt_token_ids"] == prompt and len(first["choices"]) == 2
    for j, c in enumerate(first["choices"]):
        assert c["index"] == j and c["finish_reason"] in ("length", "stop")
        content = c["logprobs"]["content"]
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in c["token_ids"]]
        assert all(
            len(e["top_logprobs"]) == 1 and e["top_logprobs"][0]["token"].startswith("token_id:") for e in content
        )
    turn1 = first["choices"][0]
    observation = tok.encode(tool_turn(template, ["42"], after_eos=turn1["token_ids"][-1] == tok.eos_token_id))
    second_prompt = prompt + turn1["token_ids"] + observation
    status, second = generate(client, second_prompt, temperature=1.0, max_tokens=4, logprobs=0, seed=4)
    assert status == 200, second
    turn2 = second["choices"][0]
    assert all(e["top_logprobs"] == [] for e in turn2["logprobs"]["content"])

    episode = second_prompt + turn2["token_ids"]
    scored = rlkjax.score(params, cfg, [episode], [len(prompt)], temperature=1.0)[0]
    n1 = len(turn1["token_ids"])
    assert_bits_equal(exact([e["logprob"] for e in turn1["logprobs"]["content"]]), scored[:n1], "turn 1")
    assert_bits_equal(
        exact([e["logprob"] for e in turn2["logprobs"]["content"]]), scored[n1 + len(observation) :], "turn 2"
    )
    status, quiet = generate(client, prompt, max_tokens=5, seed=3, n=2)  # logprobs null: none returned
    assert status == 200 and [c["token_ids"] for c in quiet["choices"]] == [c["token_ids"] for c in first["choices"]]
    assert all(c["logprobs"] is None for c in quiet["choices"])


@pytest.mark.parametrize(
    "body, match",
    [
        ({"token_ids": [1, 2], "sampling_params": {"presence_penalty": 0.5}}, "presence_penalty=0.5 is not supported"),
        ({"token_ids": [1, 2], "sampling_params": {"stop": ["x"]}}, "sampling_params.stop="),
        (
            {"token_ids": [1, 2], "sampling_params": {"temprature": 0.5}},
            r"unknown sampling_params field\(s\) \['temprature'\]",
        ),
        ({"token_ids": [1, 2], "sampling_params": {"logprobs": -1}}, "logprobs must be null or an integer"),
        ({"token_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "sampling_params: temperature must be"),
        ({"token_ids": [1, 2], "sampling_params": {}, "stream": True}, "stream must be false"),
        ({"token_ids": [1, 2], "sampling_params": {}, "priority": 3}, "priority must be 0"),
        ({"token_ids": [], "sampling_params": {}}, "token_ids must be a non-empty"),
        ({"token_ids": [1, 600], "sampling_params": {}}, r"token_ids has token id 600 outside \[0, 512\)"),
        ({"token_ids": [1, 2]}, r"missing field\(s\) \['sampling_params'\]"),
        ({"token_ids": [1, 2], "sampling_params": {}, "tools": []}, r"unknown field\(s\) \['tools'\]"),
    ],
)
def test_token_route_refuses_what_it_cannot_honour(served, body, match):
    status, out = post_raw(served[0], "/inference/v1/generate", json.dumps(body).encode())
    assert status == 400 and re.search(match, out["error"]["message"]), out


def test_context_length_400_in_vllms_words_on_every_route_and_max_model_len(served):
    client = served[0]
    words = (
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested {CONTEXT + 6} tokens "
        f"({CONTEXT - 4} in the messages, 10 in the completion). "
        "Please reduce the length of the messages or completion."
    )
    long = [7] * (CONTEXT - 4)
    cases = [
        ("/inference/v1/generate", {"token_ids": long, "sampling_params": {"max_tokens": 10}}),
        ("/v1/completions", {"prompt": long, "max_tokens": 10}),
        ("/generate", {"prompt": long, "max_new_tokens": 10}),
    ]
    for path, body in cases:
        status, out = post_raw(client, path, json.dumps(body).encode())
        assert (status, out["error"]["message"]) == (400, words), path
    too_many = {"messages": USER, "max_tokens": CONTEXT + 1}
    status, out = post_raw(client, "/v1/chat/completions", json.dumps(too_many).encode())
    assert status == 400 and out["error"]["message"].startswith(
        f"'max_tokens' is too large: {CONTEXT + 1}. This model's maximum context length is {CONTEXT} tokens"
    )
    with urllib.request.urlopen(client.url + "/v1/models", timeout=60) as r:
        models = json.loads(r.read())
    assert models["data"][0]["max_model_len"] == CONTEXT


# ----- a model that calls the calculator (tests/tool_caller.py), streamed and not -----
REPLY = [
    "I will compute it.\n",
    "<tool_call>",
    '\n{"name": "calculator", "arguments": ',
    '{"expression": "6',
    '*7"}}\n',
]
REPLY += ["</tool_call>", "\nand <tool", "_call>", '{"name": "calculator", "arguments": {"expression": "1+1"}}']
REPLY += ["<|im_end|>"]  # the second block is left open (its tag spelt in two tokens): parsed at the end


GENERATION = "<|im_start|>assistant\n"  # the generation prompt: its last token starts the reply


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    """(openai client, tokenizer, template, params) of a server whose model answers every turn with REPLY."""
    directory = tmp_path_factory.mktemp("tool_caller")
    template = ChatTemplate(QWEN3_CHAT_TEMPLATE, {})
    prompt = template.render(USER, tools=TOOLS)
    make_tool_caller(directory, [prompt, prompt + "".join(REPLY) + tool_turn(template, ["42"])], GENERATION, REPLY)
    proc, client = start_server("--model", str(directory))
    tok = load_tokenizer(directory)
    oai = openai.OpenAI(base_url=client.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    yield oai, tok, load_chat_template(tok), rlkjax.load_hf_checkpoint(directory)
    proc.terminate()
    proc.wait(timeout=60)


def test_a_model_that_calls_a_tool_streamed_and_not(caller):
    """The model writes text, a call whose arguments span three tokens, and a second call with its tag spelt
    in two tokens, left open at eos. Unstreamed: both calls in message.tool_calls, the text outside them as
    content, finish_reason tool_calls, token logprobs the bits of `rlkjax.score`. Streamed with the same seeds,
    in OpenAI's chunk shape: content before the calls, never the raw blocks; per call a chunk with its index,
    id, type and name (arguments "") then its arguments; the last chunk's finish_reason tool_calls. Assembled,
    the same message; every token's logprob once, in order, the unstreamed response's bits."""
    oai, tok, template, (cfg, params) = caller
    kw = dict(model="m", messages=USER, tools=TOOLS, max_tokens=20, n=2, seed=11, logprobs=True)
    extra = {"return_token_ids": True}
    plain = oai.chat.completions.create(**kw, extra_body=extra)
    prompt = tok.encode(template.render(USER, tools=TOOLS))
    for choice in plain.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "I will compute it.\n\nand"
        calls = [(c.function.name, c.function.arguments, c.type) for c in choice.message.tool_calls]
        assert calls == [
            ("calculator", '{"expression": "6*7"}', "function"),
            ("calculator", '{"expression": "1+1"}', "function"),
        ]
        assert choice.token_ids == [t for piece in REPLY[:-1] for t in tok.encode(piece)] + [tok.eos_token_id]
        scored = rlkjax.score(params, cfg, [prompt + choice.token_ids], [len(prompt)], temperature=1.0)[0]
        assert_bits_equal(exact([t.logprob for t in choice.logprobs.content]), scored, "plain vs learner")

    chunks = list(oai.chat.completions.create(**kw, extra_body=extra, stream=True))
    for choice in plain.choices:
        mine = [c for chunk in chunks for c in chunk.choices if c.index == choice.index]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "tool_calls"
        assert all(c.finish_reason is None for c in mine[:-1])
        content = "".join(c.delta.content or "" for c in mine)
        assert content == choice.message.content and "<tool" not in content
        deltas = [t for c in mine for t in c.delta.tool_calls or []]
        assert len(deltas) == 4  # per call: its head, then its arguments
        for index, (head, arguments) in enumerate(zip(deltas[::2], deltas[1::2])):
            sent = choice.message.tool_calls[index]
            assert (head.index, head.type, head.function.name, head.function.arguments) == (
                index,
                "function",
                sent.function.name,
                "",
            )
            assert head.id.startswith("chatcmpl-tool-") and arguments.id is None and arguments.function.name is None
            assert (arguments.index, arguments.function.arguments) == (index, sent.function.arguments)
        streamed = [t for c in mine if c.logprobs for t in c.logprobs.content]
        assert [t.token for t in streamed] == [t.token for t in choice.logprobs.content]
        assert_bits_equal(
            exact([t.logprob for t in streamed]), exact([t.logprob for t in choice.logprobs.content]), "stream vs plain"
        )
        assert [t for c in mine for t in (c.model_extra or {}).get("token_ids") or []] == choice.token_ids


def test_a_harness_sends_the_calls_and_results_back(caller):
    """What agent harnesses do next: the assistant message as the client parsed it (calls with ids, arguments as
    JSON strings, content) and a `tool` message per call, sent back with the tools. Accepted, streamed or not,
    and the prompt is the one Qwen3's template renders for that history."""
    oai, tok, template, _ = caller
    first = oai.chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=20, seed=1).choices[0]
    values = {'{"expression": "6*7"}': "42", '{"expression": "1+1"}': "2"}
    results = [
        {"role": "tool", "tool_call_id": c.id, "content": values[c.function.arguments]}
        for c in first.message.tool_calls
    ]
    history = [*USER, first.message.model_dump(exclude_none=True), *results]
    kw = dict(model="m", messages=history, tools=TOOLS, max_tokens=20, seed=2)
    plain = oai.chat.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    assert plain.finish_reason == "tool_calls"
    rendered = [*USER, first.message.model_dump(exclude_none=True), *results]
    for call in rendered[1]["tool_calls"]:  # the template writes the arguments' object out
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    assert plain.model_extra["prompt_token_ids"] == tok.encode(template.render(rendered, tools=TOOLS))
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
