"""Tasks: prompts plus a reward. A task is anything with `sample(rng, count) -> list[Example]` and
`reward(example, completion_text) -> float`.

Built-ins: `lowercase` (the default demo: a random model learns to answer in lowercase letters),
`synthetic-token-ids` (a reward over sampled token ids, for random weights at any model size), `arithmetic`
(a+b=), `gsm8k` (a GSM8K-format JSONL file; numeric answers checked), `math` (a JSONL, Parquet or CSV file of
problems with named prompt and answer fields; answers checked by math-verify), and any user reward given as
`module:function` taking (prompt_text, completion_text) -> float.

A task whose `reads_token_ids` is true is given the completion's token ids instead of its text.
A task may also have `check(example, completion_text) -> RewardResult`: the reward plus, when the check
raised or ran past its time, why (rlkjax.rl.rewards.checked_reward gives every task that form).
"""

import importlib
import re

from rlkjax.rl.data import Example, load_examples, read_jsonl
from rlkjax.rl.rewards import MathVerifier, RewardResult


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


class TokenIdsTask:
    """Synthetic: prompts as lowercase's; reward = the fraction of the completion's token ids that are multiples
    of 64. It reads ids, not text, so it works where the tokenizer cannot spell what a random model samples (the
    bytes tokenizer under a 151,936-id vocabulary). One id in 64 is rare enough that each one sampled moves its
    completion's reward against its group's, and common enough that a random model's 256-token completion holds
    about 4 of them."""

    reads_token_ids = True
    EVERY = 64

    def sample(self, rng, count):
        return LowercaseTask().sample(rng, count)

    def reward(self, example, completion):
        return sum(int(t) % self.EVERY == 0 for t in completion) / max(len(completion), 1)


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
            raise ValueError(f"reward {spec!r} must look like module:function")
        try:
            self.base, self.fn = base, getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward {spec!r}: {e}") from None
        if not callable(self.fn):
            raise ValueError(f"reward {spec!r} is not a function")
        self.reward_name = spec  # what a failure of it is called (rlkjax.rl.rewards.checked_reward)

    def sample(self, rng, count):
        return self.base.sample(rng, count)

    def reward(self, example, completion):
        return float(self.fn(example.prompt, completion))

    @property
    def examples(self):
        return getattr(self.base, "examples", ())


class MathTask:
    """Problems from a local JSONL, Parquet or CSV file (`prompt_field`, `answer_field` name the fields);
    reward 1 when math-verify finds the completion's answer equal to the reference (LaTeX, \\boxed{},
    fractions, plain numbers), each check bounded by `timeout` seconds, `workers` checks at a time
    (rlkjax.rl.rewards.MathVerifier)."""

    def __init__(
        self, path, prompt_field: str = "prompt", answer_field: str = "answer", timeout: float = 5.0, workers: int = 1
    ):
        self.examples = load_examples(path, prompt_field, answer_field)
        self.verifier = MathVerifier(timeout, workers)

    def sample(self, rng, count):
        return [self.examples[i] for i in rng.integers(0, len(self.examples), count)]

    def check(self, example, completion) -> RewardResult:
        return self.verifier(completion, example.answer)

    def check_many(self, examples, completions) -> list[RewardResult]:
        """One result per (example, completion), checked in parallel over the workers."""
        return self.verifier.check_many([(c, e.answer) for e, c in zip(examples, completions, strict=True)])

    def reward(self, example, completion):
        return self.check(example, completion).reward


def make_task(
    name: str,
    data: str | None = None,
    reward: str | None = None,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    reward_timeout: float = 5.0,
):
    """A built-in task by name; `data` is its file (gsm8k, math); `reward` a module:function replacing
    its reward; prompt_field, answer_field and reward_timeout configure `math`."""
    if name == "lowercase":
        task = LowercaseTask()
    elif name == "synthetic-token-ids":
        task = TokenIdsTask()
    elif name == "arithmetic":
        task = ArithmeticTask()
    elif name == "gsm8k":
        if not data:
            raise ValueError("task 'gsm8k' needs data: path/to/gsm8k.jsonl")
        task = GSM8KTask(data)
    elif name == "math":
        if not data:
            raise ValueError("task 'math' needs data: a .jsonl, .parquet or .csv file of problems")
        task = MathTask(data, prompt_field, answer_field, reward_timeout)
    else:
        raise ValueError(f"unknown task {name!r}: choose lowercase, synthetic-token-ids, arithmetic, gsm8k or math")
    return CustomReward(task, reward) if reward else task
