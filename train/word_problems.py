"""`python -m train.word_problems OUT_DIR`: arithmetic word problems for the math demo, written as
OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl ({"prompt": ..., "answer": ...}, the fields --task math reads by
default). Each prompt asks for the answer in \\boxed{}; answers are whole numbers, checked by math-verify.
The two files share no problem, so the evaluation is on held-out data.

`--kind calculator`: products of two 4- or 5-digit numbers, too large to do in one's head, for the calculator
environment (train.grpo --env calculator). Each row also has `turns`, a worked episode after the prompt (a
calculator call, its result, the \\boxed{} answer) that train.sft --env calculator trains on.
"""

import argparse
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


def calculator_problem(rng) -> dict:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = (int(rng.integers(1000, 100_000)) for _ in range(2))
    text = f"{name} buys {a} bags with {b} {thing}s in each. How many {thing}s is that?" + INSTRUCTION
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}})
    turns = [
        {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": f"\\boxed{{{a * b}}}"},
    ]
    return {"prompt": text, "answer": str(a * b), "turns": turns}


KINDS = {"small": problem, "calculator": calculator_problem}


def write(out_dir, train: int = 256, eval: int = 32, seed: int = 0, kind: str = "small") -> tuple[Path, Path]:
    """Write `train` and `eval` distinct problems of `kind` -> (train.jsonl, eval.jsonl)."""
    rng, seen = np.random.default_rng(seed), {}
    for _ in range(100 * (train + eval)):
        p = KINDS[kind](rng)
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
    args = parser.parse_args()
    for path in write(args.out_dir, args.train, args.eval, args.seed, args.kind):
        print(path)
