"""The math demo on CPU: the tiny real-vocabulary Qwen3 with its chat template, generated word problems with
\\boxed{} answers, math-verify rewards, eos honoured, evaluation and the TensorBoard logger, for two steps."""

import json

import pytest

from rlkjax.tasks import make_task
from rlkjax.tiny_qwen3 import write_tiny_qwen3
from train import grpo
from train.word_problems import write

IM_END = 151645


def test_word_problems_are_distinct_and_verified(tmp_path):
    train, held_out = write(tmp_path, train=40, eval=8, seed=1)
    rows = [json.loads(line) for path in (train, held_out) for line in path.read_text().splitlines()]
    assert len(rows) == 48 and len({r["prompt"] for r in rows}) == 48
    assert all(r["prompt"].endswith("\\boxed{}.") and r["answer"].isdigit() for r in rows)
    task = make_task("math", str(train))
    e = task.examples[0]
    assert task.reward(e, f"So the answer is \\boxed{{{e.answer}}}.") == 1.0
    assert task.reward(e, f"\\boxed{{{int(e.answer) + 1}}}") == 0.0


@pytest.mark.slow  # the tiny model's full-vocabulary learner and engine compile (minutes on a shared CPU)
def test_math_demo_runs(tmp_path):
    model = write_tiny_qwen3(tmp_path / "tiny_qwen3")
    train, held_out = write(tmp_path / "data", train=16, eval=3)
    config = grpo.GRPOConfig(
        model=str(model),
        task="math",
        data=str(train),
        eval_data=str(held_out),
        eval_every=1,
        enable_thinking=False,
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=6,
        max_prompt_tokens=96,
        steps=2,
        checkpoint_every=0,
        logger="tensorboard",
        table_every=1,
        progress=False,
        out=str(tmp_path / "run"),
    )
    rows = grpo.train(config)["history"]
    assert [r["step"] for r in rows] == [0, 1, 2] and all("eval_pass@2" in r for r in rows)
    assert all(r["tokens_bits_differ"] == 0 and r["reward_failures"] == 0 for r in rows[1:])
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 2 * 2 and all(s["prompt"].endswith("\\boxed{}.") for s in samples)
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "run" / "plot.png").exists()
