"""Tool calling for multi-turn episodes: Python functions registered by name with a JSON schema, Qwen3's
`<tool_call>` blocks parsed from sampled text, calls run with a time bound, results as `tool` messages.

With a checkpoint's `tokenizer` and chat `template` (rlkjax.text.tokenizer.load_tokenizer,
rlkjax.text.chat.load_chat_template):

    >>> tools = Tools()  # has the built-in `calculator`
    >>> def lookup(word: str) -> str:
    ...     return {"rlkjax": "GRPO with exact logprobs"}.get(word, "not found")
    >>> parameters = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}
    >>> _ = tools.register(lookup, description="Look a word up.", parameters=parameters)
    >>> messages = [{"role": "user", "content": "What is rlkjax?"}]
    >>> prompt = template.render(messages, tools=tools.schemas())  # the template shows them to the model
    >>> sampled_text = 'Let me check.<tool_call>\\n{"name": "lookup", "arguments": {"word": "rlkjax"}}\\n</tool_call>'
    >>> content, calls = parse_tool_calls(sampled_text)
    >>> results = [tools.run(call) for call in calls]  # strings the model reads; never raises
    >>> content, results
    ('Let me check.', ['GRPO with exact logprobs'])
    >>> tools.run_text('<tool_call>{"name": "lookup"}</tool_call>')[2]  # a bad call is an observation
    ["Error: lookup: missing argument(s) ['word']"]
    >>> next_tokens = tokenizer.encode(tool_turn(template, results))  # appended to the episode's tokens

`parse_tool_calls` reads a whole turn; `ToolCallScanner` is the same reading of a turn that arrives in pieces
(the server's streams), and `parse_arguments` the one reading of a call's arguments (sampled, or sent back in a
client's history).

A schema is OpenAI's `{"type": "function", "function": {"name", "description", "parameters"}}`, which
Qwen3's chat template lists in its system turn. Whatever goes wrong with a call (a block that is not JSON
or names no tool, an unknown tool, arguments the schema refuses, a tool that raises or runs past its time)
becomes an observation string starting "Error:", which the model reads like any result: a bad call is part
of the episode, not a crash of the runner.

Time: each call runs in a daemon thread and is waited for at most the tool's `timeout` seconds; past it
the observation says so and the runner goes on. A Python thread cannot be stopped, so a tool must bound its
own work (the calculator does: expression length, exponent, digits); the timeout bounds the episode's wait.
"""

import ast
import dataclasses
import json
import math
import operator
import re
import threading

DEFAULT_TIMEOUT = 5.0
MAX_RESULT_CHARS = 4096  # an observation longer than this is cut (the model's context is finite)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One `<tool_call>` block: `name` and `arguments` when it parsed, else `error` says why not."""

    name: str | None
    arguments: dict | None
    error: str | None = None
    text: str = ""  # the block's JSON text as sampled


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the text outside the blocks, stripped; the calls in order). A block is Qwen3's
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; one left open at the end of the text
    (the sample ran out of tokens) is parsed too. `arguments` may also be a JSON string holding the object."""
    segments = ToolCallScanner().feed(text, final=True)
    content = "".join(raw for raw, call in segments if call is None)
    return content.strip(), [call for _, call in segments if call is not None]


OPEN, CLOSE = "<tool_call>", "</tool_call>"


class ToolCallScanner:
    """Qwen3's `<tool_call>` blocks in text that arrives in pieces (a sampled turn as it streams). `feed`
    returns the segments the new text settles, in order: (text, None) for text outside the blocks and
    (block text with its tags, ToolCall) for each block once its `</tool_call>` arrives (or, with final=True,
    a block left open at the end: the sample ran out of tokens). Outside text that may be the start of a
    `<tool_call>` tag is held back until the next piece tells (a tokenizer can spell the tag in several tokens).
    Feeding a whole text at once, final, splits it as feeding it in any pieces does."""

    def __init__(self):
        self.buffer = ""  # text fed and not yet settled: a possible tag start outside, or an open block
        self.inside = False  # the buffer is an open block (it starts with <tool_call>)

    def feed(self, text: str, final: bool = False) -> list[tuple[str, ToolCall | None]]:
        self.buffer += text
        segments = []
        while True:
            if self.inside:
                end = self.buffer.find(CLOSE, len(OPEN))
                if end < 0:
                    break
                end += len(CLOSE)
                block, self.buffer, self.inside = self.buffer[:end], self.buffer[end:], False
                segments.append((block, _parse_block(block[len(OPEN) : -len(CLOSE)].strip())))
                continue
            start = self.buffer.find(OPEN)
            if start < 0:  # hold back a tail that may still become the tag
                keep = next((n for n in range(len(OPEN) - 1, 0, -1) if self.buffer.endswith(OPEN[:n])), 0)
                keep = 0 if final else keep
                if len(self.buffer) > keep:
                    segments.append((self.buffer[: len(self.buffer) - keep], None))
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            if start:
                segments.append((self.buffer[:start], None))
            self.buffer, self.inside = self.buffer[start:], True
        if final and self.inside:  # a block cut off at the end
            segments.append((self.buffer, _parse_block(self.buffer[len(OPEN) :].strip())))
            self.buffer, self.inside = "", False
        return segments


def parse_arguments(arguments) -> dict:
    """A call's arguments as the object Qwen3's template writes out: an object, a JSON string holding one
    (OpenAI's wire form, and what some models write), or null or "" for none. Raises ValueError saying why
    not. The one reading of arguments, for sampled calls and for calls a client sends back in its history."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise ValueError(f"arguments are not valid JSON ({e})") from None
    if arguments is None:
        return {}
    if not isinstance(arguments, dict):
        raise ValueError("arguments must be a JSON object (or a string holding one)")
    return arguments


def _parse_block(body: str) -> ToolCall:
    try:
        value = json.loads(body)
    except ValueError as e:
        return ToolCall(None, None, f"the tool call is not valid JSON ({e})", body)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return ToolCall(None, None, 'the tool call must be a JSON object with a "name" string', body)
    try:
        arguments = parse_arguments(value.get("arguments"))
    except ValueError as e:
        return ToolCall(value["name"], None, str(e), body)
    return ToolCall(value["name"], arguments, None, body)


_JSON_TYPES = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def check_arguments(arguments: dict, schema: dict) -> str | None:
    """Why `arguments` do not fit the parameters `schema` (required names, no unknown names when
    additionalProperties is false, each named property's JSON type), or None. A subset of JSON Schema:
    what a model gets wrong in practice, checked before the function is called."""
    properties = schema.get("properties") or {}
    missing = [name for name in schema.get("required") or [] if name not in arguments]
    if missing:
        return f"missing argument(s) {missing}"
    if schema.get("additionalProperties") is False:
        unknown = sorted(set(arguments) - set(properties))
        if unknown:
            return f"unknown argument(s) {unknown}; expected {sorted(properties)}"
    for name, value in arguments.items():
        kind = (properties.get(name) or {}).get("type")
        kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
        allowed = tuple(t for k in kinds for t in _JSON_TYPES.get(k, ()))
        if not allowed:
            continue
        is_bool = isinstance(value, bool)
        if not isinstance(value, allowed) or (is_bool and bool not in allowed):
            return f"argument {name!r} must be {' or '.join(kinds)}, got {type(value).__name__}"
    return None


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    fn: object  # called as fn(**arguments); its return value (a string, or JSON-able) is the observation
    description: str
    parameters: dict
    timeout: float

    def schema(self) -> dict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def _text(value) -> str:
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            text = str(value)
    return text if len(text) <= MAX_RESULT_CHARS else text[:MAX_RESULT_CHARS] + " ...(cut)"


class Tools:
    """Tools by name. `calculator` is registered unless builtins=False."""

    def __init__(self, builtins: bool = True):
        self.tools: dict[str, Tool] = {}
        if builtins:
            self.register(calculator, description=CALCULATOR_DESCRIPTION, parameters=CALCULATOR_PARAMETERS)

    def register(
        self, fn, name: str | None = None, description: str = "", parameters: dict | None = None, timeout=None
    ) -> Tool:
        """Register `fn` under `name` (its __name__ by default) with a JSON-schema `parameters` object
        (default: no arguments). Raises ValueError naming what is wrong."""
        name = fn.__name__ if name is None else name
        if not callable(fn):
            raise ValueError(f"tool {name!r}: fn must be callable")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(f"tool name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        if name in self.tools:
            raise ValueError(f"a tool named {name!r} is already registered")
        parameters = {"type": "object", "properties": {}} if parameters is None else parameters
        if not isinstance(parameters, dict) or parameters.get("type") != "object":
            raise ValueError(f"tool {name!r}: parameters must be a JSON schema with type 'object'")
        timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        if not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
            raise ValueError(f"tool {name!r}: timeout={timeout!r} must be a positive number of seconds")
        tool = Tool(name, fn, description, parameters, float(timeout))
        self.tools[name] = tool
        return tool

    def schemas(self) -> list[dict]:
        """What the chat template's `tools` takes (and /v1/chat/completions' `tools` field)."""
        return [t.schema() for t in self.tools.values()]

    def run(self, call: ToolCall) -> str:
        """The observation for one call: the tool's result as text, or "Error: ..." (never raises)."""
        if call.error is not None:
            return f"Error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            return f"Error: unknown tool {call.name!r}; the tools are {sorted(self.tools)}"
        problem = check_arguments(call.arguments, tool.parameters)
        if problem is not None:
            return f"Error: {tool.name}: {problem}"
        return _run_bounded(tool, call.arguments)

    def run_text(self, text: str) -> tuple[str, list[ToolCall], list[str]]:
        """Parse a sampled turn and run its calls: (content outside the blocks, calls, observations)."""
        content, calls = parse_tool_calls(text)
        return content, calls, [self.run(c) for c in calls]


def _run_bounded(tool: Tool, arguments: dict) -> str:
    outcome = {}

    def target():
        try:
            outcome["result"] = tool.fn(**arguments)
        except BaseException as e:  # noqa: BLE001 (whatever a tool raises is the model's observation)
            outcome["error"] = f"{type(e).__name__}: {str(e)[:500]}"

    thread = threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(tool.timeout)
    if thread.is_alive():
        return f"Error: {tool.name} ran past its time limit of {tool.timeout:g} s"
    if "error" in outcome:
        return f"Error: {tool.name} failed: {outcome['error']}"
    return _text(outcome.get("result"))


def tool_messages(results: list[str], calls: list[ToolCall] | None = None, ids: list[str] | None = None) -> list:
    """`tool` role messages holding the results (with `name` and `tool_call_id` where given), as the chat
    template and /v1/chat/completions take them."""
    messages = []
    for i, result in enumerate(results):
        message = {"role": "tool", "content": result}
        if calls is not None and calls[i].name is not None:
            message["name"] = calls[i].name
        if ids is not None:
            message["tool_call_id"] = ids[i]
        messages.append(message)
    return messages


def tool_turn(template, results: list[str], after_eos: bool = True, **kwargs) -> str:
    """The text that follows an assistant turn whose calls gave `results`, up to the next generation prompt:
    with Qwen3's template, "\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n". Its tokens are appended to the episode's tokens as they are (the sampled ones
    are never re-tokenised). after_eos: the sampled turn ended with the eos token (<|im_end|>), after which
    the template writes a newline. kwargs go to the template (enable_thinking=False, ...)."""
    text = template.render(tool_messages(results), add_generation_prompt=True, **kwargs)
    return ("\n" if after_eos else "") + text


# ----- the built-in calculator -----

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 10_000
MAX_DIGITS = 1_000  # of an integer result or operand
CALCULATOR_DESCRIPTION = (
    "Evaluate an arithmetic expression: numbers, + - * / // % **, unary minus and parentheses. "
    "Returns the value, or an error."
)
CALCULATOR_PARAMETERS = {
    "type": "object",
    "properties": {"expression": {"type": "string", "description": "for example (2 + 3) * 4 ** 2"}},
    "required": ["expression"],
    "additionalProperties": False,
}
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _digits(x) -> int:
    return len(str(abs(x))) if isinstance(x, int) else 0


def _check_operands(op, left, right) -> None:
    """Refuse, before computing, what would take long or give a huge number."""
    if isinstance(op, ast.Pow):
        if abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT} in absolute value")
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * math.log10(abs(left)) > MAX_DIGITS:
                raise ValueError(f"the result would have more than {MAX_DIGITS} digits")
    if isinstance(op, ast.Mult) and _digits(left) + _digits(right) > MAX_DIGITS + 1:
        raise ValueError(f"the result would have more than {MAX_DIGITS} digits")


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        _check_operands(node.op, left, right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large for a float") from None
        if isinstance(value, complex):
            raise ValueError("the result is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("the result is too large for a float")
        if _digits(value) > MAX_DIGITS:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
        return value
    raise ValueError(f"{type(node).__name__} is not allowed: only numbers, + - * / // % **, unary minus, parentheses")


def calculator(expression: str) -> str:
    """The value of an arithmetic expression, as text. Parsed with `ast` and evaluated by walking an
    allow-list of nodes (numbers, the seven binary operators, unary minus and plus): names, calls,
    attributes, subscripts, strings and everything else are refused, so nothing outside arithmetic runs.
    Bounded: MAX_EXPRESSION_CHARS characters, |exponent| <= MAX_EXPONENT, at most MAX_DIGITS digits in any
    integer result (checked before a power or product is computed). Raises ValueError saying why not."""
    if not isinstance(expression, str):
        raise ValueError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"not an arithmetic expression: {getattr(e, 'msg', e)}") from None
    try:
        return str(_evaluate(tree))
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None
