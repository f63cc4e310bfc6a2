"""Tool calls parsed from a sample's tokens as they stream (serve/tool_calls.py over rlkjax.rl.tools'
scanner): whatever rounds the tokens arrive in, the streamed content and calls assemble into the message the
whole text gives unstreamed, a call goes out in the round its block closes, the raw block never shows in the
content, and every token is released once, in order. The route end to end: tests/test_tool_server.py."""

import itertools
import json

import pytest

from rlkjax.rl.tools import ToolCallScanner
from serve.tool_calls import ToolCallStream, tool_message

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
# Per-token strings of completions: the tag whole (Qwen3's added token) or spelt over plain tokens,
# arguments over several tokens, text around calls, a block that does not parse, one cut off at the end.
PIECES = {
    "call after text": ["I will ", "compute it.\n\n", "<tool_call>", '\n{"name": "calc', 'ulator", "arguments": ']
    + ['{"expression": "6', '*7"}}\n', "</tool_call>", ""],
    "two calls, tag spelt in pieces, last one open": ["<", "tool", "_call>", '{"name": "a", "arguments": {}}']
    + ["</tool_call>", "\n", "and <tool", "_call>", '{"name": "b", "arguments": "{\\"x\\": 1}"}'],
    "bad block stays text": ["ok ", "<tool_call>", "not json", "</tool_call>", " then ", CALL, " \n"],
    "no call": ["  a <b> c ", "<tool", " d\n", "\n"],
    "only a bad block": ["<tool_call>", "{", "</tool_call>"],
    "unicode arguments": ["<tool_call>", '{"name": "say", "arguments": {"text": "héllo 🙂"}}', "</tool_call>"],
}


def splits(n: int):
    """Every way of cutting n tokens into engine rounds of 1 to 3 tokens (at most 30 of them)."""
    out = []
    for cuts in itertools.product((False, True), repeat=n - 1):
        rounds, size = [], 1
        for cut in cuts:
            if cut or size == 3:
                rounds.append(size)
                size = 1
            else:
                size += 1
        out.append([*rounds, size])
    return out[:: max(1, len(out) // 30)]


def closes(pieces: list[str]) -> list[int]:
    """The piece that completes each call's block (the last piece for a block left open)."""
    scanner, out = ToolCallScanner(), []
    for i, piece in enumerate(pieces):
        segments = scanner.feed(piece, final=i == len(pieces) - 1)
        out += [i for _, call in segments if call is not None and call.error is None]
    return out


def stream(pieces: list[str], rounds: list[int]):
    """Feed the pieces round by round: (content, calls with the round they came in, released token rows)."""
    s, content, calls, released, at = ToolCallStream(), "", [], [], 0
    for r, size in enumerate(rounds):
        part = pieces[at : at + size]
        ids = list(range(at, at + size))
        at += size
        delta, new, rows = s.add(ids, [-float(i) for i in ids], part, [None] * size, final=at == len(pieces))
        content += delta
        calls += [(index, call, r) for index, call in new]
        released += rows
    return content, calls, released


@pytest.mark.parametrize("name", PIECES)
def test_any_rounds_assemble_the_unstreamed_message(name):
    pieces = PIECES[name]
    text = "".join(pieces)
    message, called = tool_message(text)
    for rounds in splits(len(pieces)):
        content, calls, released = stream(pieces, rounds)
        assert content == (message["content"] or ""), rounds
        assert [index for index, _, _ in calls] == list(range(len(calls)))
        assert [c["function"] for _, c, _ in calls] == [c["function"] for c in message["tool_calls"]], rounds
        assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for _, c, _ in calls)
        assert [row[:3] for row in released] == [(i, -float(i), p) for i, p in enumerate(pieces)], rounds
        ends = list(itertools.accumulate(rounds))
        for (_, _, r), close in zip(calls, closes(pieces), strict=True):  # a call goes out in its block's round
            assert (ends[r - 1] if r else 0) <= close < ends[r], rounds
    assert called == bool(message["tool_calls"])
    if called:
        assert "<tool" not in (message["content"] or "").replace("<tool_call>not json</tool_call>", "")
    else:
        assert message["content"] == text  # no call: the text as it is


def test_the_unstreamed_message_of_each_case():
    """What each case's message is, written out: content less trailing whitespace when it called, a bad block
    kept as text, arguments as the JSON string of the object (non-ASCII kept)."""
    expected = {
        "call after text": ("I will compute it.", [("calculator", {"expression": "6*7"})]),
        "two calls, tag spelt in pieces, last one open": ("\nand", [("a", {}), ("b", {"x": 1})]),
        "bad block stays text": ("ok <tool_call>not json</tool_call> then", [("calculator", {"expression": "6*7"})]),
        "no call": ("  a <b> c <tool d\n\n", []),
        "only a bad block": ("<tool_call>{</tool_call>", []),
        "unicode arguments": (None, [("say", {"text": "héllo 🙂"})]),
    }
    for name, (content, calls) in expected.items():
        message, _ = tool_message("".join(PIECES[name]))
        assert message["content"] == content, name
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == calls
    arguments = tool_message("".join(PIECES["unicode arguments"]))[0]["tool_calls"][0]["function"]["arguments"]
    assert arguments == '{"text": "héllo 🙂"}'
