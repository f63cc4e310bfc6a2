"""Tool calls: Qwen3's <tool_call> blocks parsed from sampled text, every way a call can go wrong turned into
an observation (never an exception), the bounded calculator, and the real Qwen3 chat template rendering the
tool list, a call and its <tool_response> so that an episode's tokens extend turn by turn."""

import time

import pytest

from rlkjax.rl.tools import ToolCall, ToolCallScanner, Tools, calculator, parse_tool_calls, tool_messages, tool_turn
from rlkjax.text.chat import load_chat_template
from rlkjax.text.tokenizer import load_tokenizer
from rlkjax.tiny_qwen3 import write_tiny_qwen3

IM_END, TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE = 151645, 151657, 151658, 151665


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3")))


@pytest.mark.parametrize(
    "expression, value",
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("-(4 - 10)", "6"),
        ("--3", "3"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("2 ** 10", "1024"),
        ("2 ** -1", "0.5"),
        ("0.1 + 0.2", "0.30000000000000004"),
        ("1e3 * 2", "2000.0"),
        (" 6*7 ", "42"),
        ("9 ** 1000", str(9**1000)),  # 955 digits: under the bound
        ("(" * 99 + "-1" + ")" * 99, "-1"),  # as deep as 200 characters nest
    ],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, why",
    [
        ("__import__('os').system('true')", "Call is not allowed"),
        ("open('/etc/passwd').read()", "is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("[1, 2][0]", "is not allowed"),
        ("'a' * 3", "Constant is not allowed"),
        ("True + 1", "Constant is not allowed"),
        ("1j * 2", "Constant is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("1 << 100", "BinOp is not allowed"),
        ("~1", "UnaryOp is not allowed"),
        ("import os", "not an arithmetic expression"),
        ("1 +", "not an arithmetic expression"),
        ("1 + " * 60 + "1", "longer than 200 characters"),
        ("2 ** 100000", "exponent 100000 is larger than 10000"),
        ("9 ** 9 ** 9", "larger than 10000"),
        ("10 ** 1001", "more than 1000 digits"),
        ("(10 ** 600) * (10 ** 600)", "more than 1000 digits"),
        ("10.0 ** 400", "too large for a float"),
        ("1e308 * 10", "too large for a float"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
    ],
)
def test_calculator_refuses(expression, why):
    with pytest.raises(ValueError, match=why):
        calculator(expression)


def test_parse_several_calls_and_the_text_around_them():
    text = (
        "Let me compute both.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup", "arguments": "{\\"q\\": \\"x\\"}"}\n</tool_call>'
        '\nDone.<tool_call>\n{"name": "calculator", "arguments": {"expression": "1'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute both.\n\n\nDone."
    assert calls[0] == ToolCall("calculator", {"expression": "2+2"}, None, calls[0].text)
    assert calls[1].name == "lookup" and calls[1].arguments == {"q": "x"}  # arguments as a JSON string
    assert calls[2].error.startswith("the tool call is not valid JSON")  # cut off by max_tokens
    assert parse_tool_calls("no calls here ") == ("no calls here", [])


def test_every_bad_call_is_an_observation(tmp_path):
    def fails(x: int):
        raise RuntimeError(f"broken for {x}")

    def sleeps():
        time.sleep(30)

    tools = Tools()
    tools.register(fails, parameters={"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    tools.register(sleeps, timeout=0.3)
    cases = {
        "<tool_call>\nnot json\n</tool_call>": "Error: the tool call is not valid JSON",
        '<tool_call>\n{"arguments": {}}\n</tool_call>': 'Error: the tool call must be a JSON object with a "name"',
        '<tool_call>\n["calculator"]\n</tool_call>': 'Error: the tool call must be a JSON object with a "name"',
        '<tool_call>\n{"name": "calculator", "arguments": [1]}\n</tool_call>': "Error: arguments must be a JSON object",
        '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>': "Error: unknown tool 'rm'; the tools are",
        '<tool_call>\n{"name": "calculator"}\n</tool_call>': "Error: calculator: missing argument(s) ['expression']",
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": 3}}\n</tool_call>': (
            "Error: calculator: argument 'expression' must be string, got int"
        ),
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1", "y": 2}}\n</tool_call>': (
            "Error: calculator: unknown argument(s) ['y']"
        ),
        '<tool_call>\n{"name": "fails", "arguments": {"x": true}}\n</tool_call>': (
            "Error: fails: argument 'x' must be integer, got bool"
        ),
        '<tool_call>\n{"name": "fails", "arguments": {"x": 3}}\n</tool_call>': (
            "Error: fails failed: RuntimeError: broken for 3"
        ),
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "os.getcwd()"}}\n</tool_call>': (
            "Error: calculator failed: ValueError: Call is not allowed"
        ),
        '<tool_call>\n{"name": "sleeps", "arguments": {}}\n</tool_call>': (
            "Error: sleeps ran past its time limit of 0.3 s"
        ),
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>': "42",
    }
    for text, observation in cases.items():
        start = time.monotonic()
        content, calls, results = tools.run_text(text)
        assert content == "" and len(results) == 1
        assert results[0].startswith(observation), (text, results[0])
        assert time.monotonic() - start < 5.0  # the sleeping tool is waited for 0.3 s, not 30


def test_register_refuses_bad_tools():
    tools = Tools()
    with pytest.raises(ValueError, match="already registered"):
        tools.register(calculator)
    with pytest.raises(ValueError, match="type 'object'"):
        tools.register(len, parameters={"type": "string"})
    with pytest.raises(ValueError, match="timeout"):
        tools.register(len, timeout=0)
    with pytest.raises(ValueError, match="tool name"):
        tools.register(len, name="no spaces")
    assert [s["function"]["name"] for s in tools.schemas()] == ["calculator"]


def test_the_qwen3_template_renders_tools_and_an_episode_extends_turn_by_turn(tokenizer):
    """The real Qwen3 template lists the tools' schemas in its system turn; a sampled call's result goes back
    as a `tool` message rendered as a <tool_response> user turn. The episode (the prompt's tokens, the sampled
    tokens up to <|im_end|>, then tool_turn's tokens) is the same text and the same ids as the template's
    rendering of the whole conversation: each turn appends to the previous tokens, nothing is re-tokenised."""
    template, tools = load_chat_template(tokenizer), Tools()
    user = [{"role": "user", "content": "What is 6 times 7?"}]
    prompt = template.render(user, tools=tools.schemas())
    assert prompt.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert '{"type": "function", "function": {"name": "calculator", "description": "Evaluate' in prompt
    sampled = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    content, calls, results = tools.run_text(sampled)
    assert (content, results) == ("", ["42"])
    turn = tool_turn(template, results)
    assert turn == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    episode = tokenizer.encode(prompt) + tokenizer.encode(sampled) + [IM_END] + tokenizer.encode(turn)

    call = {"type": "function", "function": {"name": "calculator", "arguments": calls[0].arguments}}
    history = [*user, {"role": "assistant", "content": "", "tool_calls": [call]}]
    history += tool_messages(results, calls, ids=["call-0"])
    whole = template.render(history, tools=tools.schemas())
    assert whole == prompt + sampled + "<|im_end|>" + turn
    assert episode == tokenizer.encode(whole)
    assert [episode.count(t) for t in (TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE)] == [3, 3, 1]
    # two results: one user turn holding both responses
    both = tool_turn(template, ["4", "Error: unknown tool 'x'"], enable_thinking=False)
    assert both == (
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\nError: unknown tool 'x'\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_the_scanner_reads_a_text_in_pieces_as_it_reads_it_whole():
    """The one parser of <tool_call> blocks also reads a turn as it streams (serve/tool_calls.py): fed whole or
    a character at a time, the same segments (outside text may come in several); a possible tag start is held
    back until the next piece tells, never lost; parse_tool_calls is the whole text fed at once."""
    texts = [
        'Let me.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>\nok',
        'a <b> <tool <tool_call>{"name": "f"}</tool_call></tool_call><tool_call>{"name": "g", "argu',
        "<tool_call>not json</tool_call> x <tool_cal",
        "no calls",
    ]
    for text in texts:
        whole = ToolCallScanner().feed(text, final=True)
        assert "".join(raw for raw, _ in whole) == text
        scanner, merged = ToolCallScanner(), []
        for i, ch in enumerate(text):
            for raw, call in scanner.feed(ch, final=i == len(text) - 1):
                if call is None and merged and merged[-1][1] is None:
                    merged[-1] = (merged[-1][0] + raw, None)
                else:
                    merged.append((raw, call))
        assert merged == whole, text
    content, calls = parse_tool_calls(texts[1])
    assert content == "a <b> <tool </tool_call>" and [c.name for c in calls] == ["f", None]
    scanner = ToolCallScanner()
    assert scanner.feed("a <too") == [("a ", None)]
    assert scanner.feed("ls>") == [("<tools>", None)]
