"""Tool calling on /v1/chat/completions, as vLLM serves Qwen3 (its `hermes` tool parser): `tools` and
`tool_choice` checked and handed to the chat template, a conversation's earlier calls and results accepted,
and Qwen3's <tool_call> blocks in a completion returned as `message.tool_calls`.

- tools: OpenAI's [{"type": "function", "function": {"name", "description", "parameters"}}], rendered by the
  chat template (Qwen3's lists them in its system turn).
- tool_choice: "auto" (the default with tools: calls are parsed), "none" (the tools are still rendered, as
  vLLM renders them, and the text comes back as it is). "required" and a named function need constrained
  decoding, which this server does not do: 400, rather than a call the model was not made to write.
- A completion's calls: every <tool_call> block (one cut off at the end included) parsed as JSON
  {"name", "arguments"} becomes {"id", "type": "function", "function": {"name", "arguments": JSON string}};
  content is the text outside the blocks (null if none) and finish_reason "tool_calls". A block that does not
  parse leaves the whole text as content, with no calls, as vLLM does.
- History: an assistant message with `tool_calls` (its content absent, null or "") and `tool` messages with
  `tool_call_id`; arguments given as a JSON string are read into the object the template writes out.
"""

import json
import uuid

from rlkjax.core.checks import shown
from rlkjax.rl.tools import parse_arguments, parse_tool_calls
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


def tool_message(text: str) -> tuple[dict, bool]:
    """(the assistant message for a completion's text, whether it called tools), with vLLM's ids and shape."""
    content, calls = parse_tool_calls(text)
    if not calls or any(c.error is not None for c in calls):
        return {"role": "assistant", "content": text, "tool_calls": []}, False
    tool_calls = [
        {
            "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in calls
    ]
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}, True
