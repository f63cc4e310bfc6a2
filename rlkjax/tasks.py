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


class LowercaseTask:
    """Prompts are short random strings; reward = fraction of the completion's bytes that are
    lowercase ASCII letters. A random byte-level model starts near 26/512 and can reach 1."""

    def sample(self, rng, count):
        return [Example("".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"), int(rng.integers(3, 8)))) + ":")
                for _ in range(count)]

    def reward(self, example, completion):
        return sum("a" <= c <= "z" for c in completion) / max(len(completion), 1)


class ArithmeticTask:
    """`a+b=` with a, b < 50; reward 1 when the completion starts with the sum."""

    def sample(self, rng, count):
        pairs = rng.integers(0, 50, (count, 2))
        return [Example(f"{a}+{b}=", str(a + b)) for a, b in pairs]

    def reward(self, example, completion):
        return float(re.match(r"\s*(-?\d+)", completion) is not None and re.match(r"\s*(-?\d+)", completion).group(1) == example.answer)


def last_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d[\d,]*\.?\d*", text)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


class GSM8KTask:
    """GSM8K JSONL ({"question": ..., "answer": "... #### 42"}); reward 1 when the last number in
    the completion equals the final answer."""

    def __init__(self, path):
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        if not rows:
            raise ValueError(f"{path} has no examples")
        self.examples = []
        for i, row in enumerate(rows):
            if "question" not in row or "####" not in row.get("answer", ""):
                raise ValueError(f"{path}:{i + 1}: need 'question' and an 'answer' ending in '#### <number>'")
            self.examples.append(Example(row["question"], row["answer"].split("####")[-1].strip().replace(",", "")))

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
        self.base, self.fn = base, getattr(importlib.import_module(module), name)

    def sample(self, rng, count):
        return self.base.sample(rng, count)

    def reward(self, example, completion):
        return float(self.fn(example.prompt, completion))


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

