"""Tool calling on /v1/chat/completions, as vLLM serves Qwen3 (its `hermes` tool parser): `tools` and
`tool_choice` checked and handed to the chat template, a conversation's earlier calls and results accepted,
and Qwen3's <tool_call> blocks in a completion returned as `message.tool_calls`.

- tools: OpenAI's [{"type": "function", "function": {"name", "description", "parameters"}}], rendered by the
  chat template (Qwen3's lists them in its system turn).
- tool_choice: "auto" (the default with tools: calls are parsed), "none" (the tools are still rendered, as
  vLLM renders them, and the text comes back as it is). "required" and a named function need constrained
  decoding, which this server does not do: 400, rather than a call the model was not made to write.
- A completion's calls: every <tool_call> block (one cut off at the end included) parsed as JSON
  {"name", "arguments"} becomes {"id", "type": "function", "function": {"name", "arguments": JSON string}},
  and finish_reason is "tool_calls"; content is the text outside the calls, less its trailing whitespace
  (null if none). A block that does not parse stays in the content as text (vLLM drops every call of such a
  completion; a stream cannot take back a call it sent, so each block stands alone here, streamed or not).
- Streamed (stream: true), in OpenAI's and vLLM's chunk shape: text before a call as `delta.content`; each call
  once its block closes as two chunks, `delta.tool_calls` [{"index", "id", "type", "function": {"name",
  "arguments": ""}}] then [{"index", "function": {"arguments"}}]; the raw block text never in the content.
  The chunks assemble into the message the same request gets unstreamed (MessageStream reads both), and the
  tokens' logprobs come once each, in order, in the chunk that settles their text.
- History: an assistant message with `tool_calls` (its content absent, null or "") and `tool` messages with
  `tool_call_id`; arguments given as a JSON string are read into the object the template writes out.
"""

import json
import uuid

from rlkjax.core.checks import shown
from rlkjax.rl.tools import ToolCall, ToolCallScanner, parse_arguments
from rlkjax.text.chat import message_text
from serve.http import BadRequest


def _check_tool(i: int, tool) -> dict:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise BadRequest(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}')
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise BadRequest(f"tools[{i}].function.name must be a non-empty string")
    if not isinstance(function.get("description", ""), (str, type(None))):
        raise BadRequest(f"tools[{i}].function.description must be a string")
    if not isinstance(function.get("parameters", {}), (dict, type(None))):
        raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object")
    return tool


def request_tools(body: dict) -> tuple[list | None, bool]:
    """(the tools for the chat template or None, whether to parse the completions' tool calls)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools must be a list of function tools")
    tools = [_check_tool(i, t) for i, t in enumerate(tools)] if tools else None
    choice = ("auto" if tools else "none") if choice is None else choice
    if choice == "none":
        return tools, False
    if choice == "auto":
        if not tools:
            raise BadRequest('tool_choice "auto" needs tools')
        return tools, True
    if choice == "required" or isinstance(choice, dict):
        raise BadRequest(
            f"tool_choice {shown(choice)} needs constrained decoding, which this server does not do: "
            'use "auto" (the model decides, calls are parsed) or "none"'
        )
    raise BadRequest(f'tool_choice must be "auto" or "none", got {shown(choice)}')


def _history_call(where: str, call) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(f'{where} must be {{"type": "function", "function": {{"name": str, "arguments": ...}}}}')
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise BadRequest(f"{where}.id must be a string")
    try:  # OpenAI sends a JSON string; the template writes the object out
        arguments = parse_arguments(function.get("arguments"))
    except ValueError as e:
        raise BadRequest(f"{where}.function.{e}") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def history_message(i: int, m: dict) -> dict:
    """Message i of a request, ready for the chat template: its content as text; an assistant's tool calls
    with their arguments as objects; a tool result's tool_call_id checked."""
    if m.get("role") == "assistant" and m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise BadRequest(f"messages[{i}].tool_calls must be a list")
        calls = [_history_call(f"messages[{i}].tool_calls[{k}]", c) for k, c in enumerate(calls)]
        content = m.get("content")
        return m | {"content": "" if content is None else message_text(content), "tool_calls": calls}
    if m.get("role") == "tool" and m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
        raise BadRequest(f"messages[{i}].tool_call_id must be a string")
    return m | {"content": message_text(m.get("content"))}


class MessageStream:
    """A sample's text, as it grows, split into the assistant message's content and tool calls: the one
    reading of a completion, streamed or not (the whole text at once, final: `tool_message`).

    Each <tool_call> block becomes a call once it closes (or the text ends inside it); a block that does not
    parse stays in the content as the text it is. The content is the text outside the calls, its trailing
    whitespace dropped when the text called a tool (the newlines Qwen3 writes around its calls); without a
    call it is the text unchanged. So trailing whitespace is held back until more content comes or the text
    ends, and a possible tag start until the next piece tells."""

    def __init__(self):
        self.scanner = ToolCallScanner()
        self.fed = 0  # characters of the text fed so far
        self.pending = ""  # trailing whitespace of the content so far, not sent yet
        self.called = False  # a call was sent

    def add(self, text: str, final: bool) -> tuple[str, list[dict], int]:
        """Feed the text's next piece; returns (content to send, calls to send in OpenAI's shape, how many of
        the text's characters are settled: sent, or part of a call sent)."""
        self.fed += len(text)
        content, calls = "", []
        for raw, call in self.scanner.feed(text, final):
            if call is not None and call.error is None:
                calls.append(openai_call(call))
                continue
            joined = self.pending + raw
            kept = joined.rstrip()
            content += kept
            self.pending = joined[len(kept) :]
        self.called = self.called or bool(calls)
        if final:
            content += "" if self.called else self.pending
            self.pending = ""
        return content, calls, self.fed - len(self.scanner.buffer) - len(self.pending)


def openai_call(call: ToolCall) -> dict:
    """A parsed call in OpenAI's shape, with vLLM's ids; arguments as the JSON string of the object."""
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }


def tool_message(text: str) -> tuple[dict, bool]:
    """(the assistant message for a completion's text, whether it called tools)."""
    content, calls, _ = MessageStream().add(text, final=True)
    if not calls:
        return {"role": "assistant", "content": content, "tool_calls": []}, False
    return {"role": "assistant", "content": content or None, "tool_calls": calls}, True


class ToolCallStream:
    """One streamed sample's tokens with its tool calls parsed: a round's tokens in; out, the content and calls
    to send and the tokens whose text is settled (held ones wait for a later round, or the end)."""

    def __init__(self):
        self.message = MessageStream()
        self.held: list[tuple] = []  # (token, logprob, piece, top) of tokens whose text is not settled
        self.ends: list[int] = []  # each held token's text end, in characters of the whole text
        self.calls = 0  # calls sent: the next one's index

    def add(self, tokens, logprobs, pieces, tops, final: bool) -> tuple[str, list[tuple[int, dict]], list[tuple]]:
        """(content, calls with their index in the message, released tokens as (token, logprob, piece, top)
        rows, in order)."""
        end = self.message.fed
        for row in zip(tokens, logprobs, pieces, tops):
            end += len(row[2])
            self.held.append(row)
            self.ends.append(end)
        content, calls, settled = self.message.add("".join(pieces), final)
        count = len(self.held) if final else sum(e <= settled for e in self.ends)
        released, self.held, self.ends = self.held[:count], self.held[count:], self.ends[count:]
        indexed = list(enumerate(calls, self.calls))
        self.calls += len(calls)
        return content, indexed, released
