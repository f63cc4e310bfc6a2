"""Tasks: prompts plus a reward. A task is anything with `sample(rng, count) -> list[Example]` and
`reward(example, completion_text) -> float`.

Built-ins: `lowercase` (the default demo: a random model learns to answer in lowercase letters),
`arithmetic` (a+b=), `gsm8k` (a GSM8K-format JSONL file; numeric answers checked), and any user
reward given as `module:function` taking (prompt_text, completion_text) -> float.
"""

import dataclasses
import importlib
import json
import re
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Example:
    prompt: str
    answer: str = ""
    source: str = ""  # where it came from, for errors: "file:line" for a data file


class LowercaseTask:
    """Prompts are short random strings; reward = fraction of the completion's bytes that are
    lowercase ASCII letters. A random byte-level model starts near 26/512 and can reach 1."""

    def sample(self, rng, count):
        return [
            Example("".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"), int(rng.integers(3, 8)))) + ":")
            for _ in range(count)
        ]

    def reward(self, example, completion):
        return sum("a" <= c <= "z" for c in completion) / max(len(completion), 1)


class ArithmeticTask:
    """`a+b=` with a, b < 50; reward 1 when the completion starts with the sum."""

    def sample(self, rng, count):
        pairs = rng.integers(0, 50, (count, 2))
        return [Example(f"{a}+{b}=", str(a + b)) for a, b in pairs]

    def reward(self, example, completion):
        return float(
            re.match(r"\s*(-?\d+)", completion) is not None
            and re.match(r"\s*(-?\d+)", completion).group(1) == example.answer
        )


def last_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d[\d,]*\.?\d*", text)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def read_jsonl(path) -> list[tuple[int, dict]]:
    """(1-based line number, object) for each non-blank line of a UTF-8 JSONL file. Lines are split on
    "\n" only (JSON strings may hold U+2028 and other characters str.splitlines breaks at); a bad file
    or line raises a one-line ValueError naming the file and the line."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the data file ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); expected JSON lines"
        ) from None
    rows = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise ValueError(f"{path}:{number}: JSON nested too deeply") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        rows.append((number, row))
    return rows


class GSM8KTask:
    """GSM8K JSONL ({"question": ..., "answer": "... #### 42"}); reward 1 when the last number in
    the completion equals the final answer. Every line is checked when the file is loaded."""

    def __init__(self, path):
        self.examples = []
        for number, row in read_jsonl(path):
            question, answer = row.get("question"), row.get("answer")
            for name, value in (("question", question), ("answer", answer)):
                if not isinstance(value, str):
                    raise ValueError(
                        f"{path}:{number}: '{name}' must be a string, got "
                        f"{'nothing' if value is None else type(value).__name__}"
                    )
            final = answer.split("####")[-1].strip().replace(",", "")
            if not question.strip() or "####" not in answer or not re.fullmatch(r"-?\d+(\.\d+)?", final):
                raise ValueError(
                    f"{path}:{number}: need a non-empty 'question' and an 'answer' ending in '#### <number>'"
                )
            self.examples.append(Example(question, final, f"{path}:{number}"))
        if not self.examples:
            raise ValueError(f"{path}: no examples")

    def sample(self, rng, count):
        return [self.examples[i] for i in rng.integers(0, len(self.examples), count)]

    def reward(self, example, completion):
        got = last_number(completion)
        try:
            return float(got is not None and float(got) == float(example.answer))
        except ValueError:
            return 0.0


class CustomReward:
    """Prompts from `base`, reward from a user function f(prompt_text, completion_text) -> float."""

    def __init__(self, base, spec: str):
        module, _, name = spec.partition(":")
        if not name:
            raise ValueError(f"--reward {spec!r} must look like module:function")
        try:
            self.base, self.fn = base, getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--reward {spec!r}: {e}") from None
        if not callable(self.fn):
            raise ValueError(f"--reward {spec!r} is not a function")

    def sample(self, rng, count):
        return self.base.sample(rng, count)

    def reward(self, example, completion):
        return float(self.fn(example.prompt, completion))

    @property
    def examples(self):
        return getattr(self.base, "examples", ())


def make_task(name: str, data: str | None = None, reward: str | None = None):
    if name == "lowercase":
        task = LowercaseTask()
    elif name == "arithmetic":
        task = ArithmeticTask()
    elif name == "gsm8k":
        if not data:
            raise ValueError("--task gsm8k needs --data path/to/gsm8k.jsonl")
        task = GSM8KTask(data)
    else:
        raise ValueError(f"unknown task {name!r}: choose lowercase, arithmetic or gsm8k")
    return CustomReward(task, reward) if reward else task
