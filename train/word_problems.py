"""`python -m train.word_problems OUT_DIR`: arithmetic word problems for the math demo, written as
OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl ({"prompt": ..., "answer": ...}, the fields --task math reads by
default). Each prompt asks for the answer in \\boxed{}; answers are whole numbers, checked by math-verify.
The two files share no problem, so the evaluation is on held-out data.

`--kind calculator`: products of two 4- or 5-digit numbers, too large to do in one's head, for the calculator
environment (train.grpo --env calculator). Each row also has `turns`, a worked episode after the prompt (a
calculator call, its result, the \\boxed{} answer) that train.sft --env calculator trains on. `--digits LO-HI`
(or `--digits N`) sets the factors' size: `--digits 2` gives products of two 2-digit numbers (3-4 digit results).
`--guesses F`: in a fraction F of the rows (drawn at random) the worked episode answers at once, without the tool,
with a guess (the product of two other numbers of the factors' size), as a model that multiplies in its head does;
a warm-up on such rows calls the calculator in about 1 - F of its episodes, which leaves GRPO a choice to learn.
"""

import argparse
import functools
import json
from pathlib import Path

import numpy as np

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana")
THINGS = ("apple", "book", "coin", "marble", "pencil", "stamp")
INSTRUCTION = " Put the final answer in \\boxed{}."


def problem(rng) -> dict:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = (int(x) for x in rng.integers(2, 10, 2))
    kind = int(rng.integers(0, 3))
    if kind == 0:
        text, answer = f"{name} has {a} {thing}s and gets {b} more. How many {thing}s does {name} have now?", a + b
    elif kind == 1:
        a += b  # never below zero
        text, answer = f"{name} has {a} {thing}s and gives away {b}. How many {thing}s are left?", a - b
    else:
        text, answer = f"{name} buys {a} bags with {b} {thing}s in each. How many {thing}s is that?", a * b
    return {"prompt": text + INSTRUCTION, "answer": str(answer)}


MAX_DIGITS = 9


def parse_digits(spec: str) -> tuple[int, int]:
    """`LO-HI` or `N` -> (LO, HI), each factor's fewest and most digits; ValueError says what is wrong."""
    lo, _, hi = str(spec).partition("-")
    try:
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"digits={spec!r}: write LO-HI or N, whole numbers (e.g. 2-3 or 2)") from None
    if not 1 <= lo <= hi <= MAX_DIGITS:
        raise ValueError(f"digits={spec!r}: need 1 <= LO <= HI <= {MAX_DIGITS}")
    return lo, hi


def calculator_problem(rng, digits: tuple[int, int] = (4, 5), guesses: float = 0.0) -> dict:
    """Two factors drawn uniformly from the whole numbers of digits[0] to digits[1] digits; with probability
    `guesses` the worked episode is a guess instead of a call."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    factor = functools.partial(rng.integers, 10 ** (digits[0] - 1), 10 ** digits[1])
    a, b = int(factor()), int(factor())
    text = f"{name} buys {a} bags with {b} {thing}s in each. How many {thing}s is that?" + INSTRUCTION
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}})
    if guesses and rng.random() < guesses:
        turns = [{"role": "assistant", "content": f"\\boxed{{{int(factor()) * int(factor())}}}"}]
    else:
        turns = [
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": f"\\boxed{{{a * b}}}"},
        ]
    return {"prompt": text, "answer": str(a * b), "turns": turns}


KINDS = {"small": problem, "calculator": calculator_problem}


def write(
    out_dir,
    train: int = 256,
    eval: int = 32,
    seed: int = 0,
    kind: str = "small",
    digits: str | None = None,
    guesses: float = 0.0,
) -> tuple[Path, Path]:
    """Write `train` and `eval` distinct problems of `kind` -> (train.jsonl, eval.jsonl). `digits` ("LO-HI" or
    "N") and `guesses` (a fraction), calculator problems only: each factor's digits (default 4-5), and the
    fraction of worked episodes that guess instead of calling the calculator."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: choose one of {', '.join(sorted(KINDS))}")
    given = [f"{name}={value!r}" for name, value in (("digits", digits), ("guesses", guesses)) if value]
    if given and kind != "calculator":
        raise ValueError(f"{', '.join(given)}: only calculator problems take this")
    if not 0.0 <= guesses <= 1.0:
        raise ValueError(f"guesses={guesses!r}: need a fraction from 0 to 1")
    make = KINDS[kind]
    if kind == "calculator":
        make = functools.partial(calculator_problem, digits=parse_digits(digits or "4-5"), guesses=guesses)
    rng, seen = np.random.default_rng(seed), {}
    for _ in range(100 * (train + eval)):
        p = make(rng)
        seen.setdefault(p["prompt"], p)
        if len(seen) == train + eval:
            break
    else:
        raise ValueError(f"could not write {train + eval} distinct problems")
    problems = list(seen.values())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "eval.jsonl"
    for path, rows in zip(paths, (problems[:train], problems[train:])):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=int, default=256, help="training problems")
    parser.add_argument("--eval", type=int, default=32, help="held-out problems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kind", choices=sorted(KINDS), default="small", help="small sums and products, or calculator")
    parser.add_argument(
        "--digits",
        help="calculator problems: each factor has LO to HI digits, written LO-HI or N (default 4-5)",
    )
    parser.add_argument(
        "--guesses",
        type=float,
        default=0.0,
        help="calculator problems: the fraction of worked episodes that answer with a guess instead of a call",
    )
    args = parser.parse_args()
    try:
        paths = write(args.out_dir, args.train, args.eval, args.seed, args.kind, args.digits, args.guesses)
    except ValueError as e:
        parser.error(str(e))
    for path in paths:
        print(path)
