"""Errors a user can act on: a malformed model, tokenizer or template file is a ValueError naming the file; an
environment whose constructor, reset or step raises stops the run naming the step, the environment's class, the
example's file and line, the turn and the exception; a reward that raises is reported with the reward's name."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from rlkjax.core.checkpoint import load_hf_checkpoint
from rlkjax.core.config import ModelConfig
from rlkjax.rl.data import Example
from rlkjax.rl.environments import Environment, EnvironmentFailure, Step, load_environment
from rlkjax.rl.rewards import checked_reward
from rlkjax.rl.tasks import make_task
from rlkjax.text.chat import ChatTemplate, prompt_format
from rlkjax.text.tokenizer import ByteTokenizer, load_tokenizer
from tests.helpers import EOS
from tests.test_episodes import COMPACT, ask_again_run
from train import grpo
from train.config import GRPOConfig
from train.episodes import EpisodeRunner
from train.rewards import episode_rewards

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "fixtures" / "hf_qwen3_tied"  # config.json + model.safetensors, no tokenizer


class RaisingStep(Environment):
    """Asks "?" after turn 1, raises on turn 2."""

    def reset(self, example):
        return [{"role": "user", "content": example.prompt}]

    def step(self, episode):
        if len(episode.turns) >= 2:
            raise RuntimeError("no answer to turn 2")
        return Step([{"role": "user", "content": "?"}], 0.0, False)


class RaisingInit(Environment):
    def __init__(self, task):
        raise TypeError("needs a tool registry")


class RewardRaisesOnTurn2(Environment):
    """Turn 1 asks "?"; turn 2's reward is a user reward that raises (checked_reward keeps the run going)."""

    def step(self, episode):
        if len(episode.turns) < 2:
            return Step([{"role": "user", "content": "?"}], 0.0, False)
        return Step([], checked_reward(self.task, episode.example, episode.turns[-1].text), True)


def broken_reward(prompt, completion):
    raise ZeroDivisionError("division by zero")


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    """Malformed inputs: a config.json that is not JSON, one without vocab_size, a safetensors file that is not
    one, a checkpoint with a broken tokenizer.json, a template that does not parse, a data file and its row."""
    root = tmp_path_factory.mktemp("bad")
    for name in ("not_json", "no_vocab", "bad_weights", "bad_tokenizer"):
        (root / name).mkdir()
    (root / "not_json" / "config.json").write_text("{model_type: qwen3")
    (root / "no_vocab" / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64}))
    shutil.copy(TINY / "config.json", root / "bad_weights")
    (root / "bad_weights" / "model.safetensors").write_bytes(b"not safetensors")
    for f in ("config.json", "model.safetensors"):
        shutil.copy(TINY / f, root / "bad_tokenizer")
    (root / "bad_tokenizer" / "tokenizer.json").write_text('{"model": ')
    (root / "template.jinja").write_text("{% for m in messages %}{{ m.content }")
    (root / "problems.jsonl").write_text(json.dumps({"question": "What is 1+1?", "answer": "so #### 2"}) + "\n")
    (root / "compact.jinja").write_text(COMPACT)
    return root


def test_loaders_name_the_malformed_file(bad_files):
    """rlkjax's loaders: a malformed file is a ValueError naming it (a JSONDecodeError, KeyError, SafetensorError
    or the tokenizers library's bare Exception used to escape without the file's name)."""
    cases = [
        (lambda: ModelConfig.from_hf_config(bad_files / "not_json" / "config.json"), "not_json/config.json: not valid"),
        (lambda: ModelConfig.from_hf_config(bad_files / "no_vocab" / "config.json"), "no integer 'vocab_size'"),
        (lambda: load_hf_checkpoint(bad_files / "bad_weights"), "model.safetensors: not a readable safetensors"),
        (lambda: load_tokenizer(bad_files / "bad_tokenizer"), "tokenizer.json: not a tokenizer"),
        (lambda: prompt_format(str(bad_files / "template.jinja"), ByteTokenizer()), "not a valid Jinja template"),
    ]
    for load, match in cases:
        with pytest.raises(ValueError, match=match):
            load()


def test_an_env_that_does_not_build_is_named():
    with pytest.raises(EnvironmentFailure) as failure:
        load_environment("tests.test_entry_errors:RaisingInit", None)
    assert str(failure.value) == (
        "--env 'tests.test_entry_errors:RaisingInit': RaisingInit(task) raised: TypeError: needs a tool registry"
    )


def test_env_step_failure_names_step_class_example_and_turn():
    """EpisodeRunner: a step that raises on turn 2 stops the episode with an EnvironmentFailure naming where (the
    trainer's step), the class and method, the turn, the example and the exception, raised from it."""
    runner = EpisodeRunner(RaisingStep(None), ByteTokenizer(), ChatTemplate(COMPACT, {}), EOS, 3, 64, 40)
    example = Example("What is 1+1?", "2", "problems.jsonl:4")
    episode = runner.start(example, "step 7")
    turn = {"tokens": [ord("x"), EOS], "logprobs": np.zeros(2, np.float32), "policy_version": 0}
    runner.advance(episode, turn, "step 7")
    with pytest.raises(EnvironmentFailure) as failure:
        runner.advance(episode, turn, "step 7")
    assert str(failure.value) == (
        "step 7: tests.test_entry_errors.RaisingStep.step raised on turn 2 of example problems.jsonl:4: "
        "RuntimeError: no answer to turn 2"
    )
    assert isinstance(failure.value.__cause__, RuntimeError)


@pytest.mark.slow  # compiles the engine
def test_train_grpo_stops_at_an_env_step_that_raises(tmp_path, bad_files):
    """train.grpo --env through the real engine: the environment's step raises on an episode's second turn, and
    the run stops there with the step, the class, the example (the data file's line) and the turn named."""
    data = str(bad_files / "problems.jsonl")
    flags = ask_again_run(tmp_path, steps=2, out=str(tmp_path / "run"))
    flags |= dict(env="tests.test_entry_errors:RaisingStep", task="gsm8k", data=data)
    with pytest.raises(EnvironmentFailure) as failure:
        grpo.train(GRPOConfig(**flags))
    assert str(failure.value) == (
        f"step 1: tests.test_entry_errors.RaisingStep.step raised on turn 2 of example {data}:1: "
        "RuntimeError: no answer to turn 2"
    )


def test_a_reward_that_raises_is_named_with_its_turn(caplog):
    """A user reward that raises inside an environment's step: reward 0, counted, and the warning names the step,
    the example, the turn and the reward function with its exception (the run goes on)."""
    task = make_task("arithmetic", reward="tests.test_entry_errors:broken_reward")
    runner = EpisodeRunner(RewardRaisesOnTurn2(task), ByteTokenizer(), ChatTemplate(COMPACT, {}), EOS, 3, 64, 40)
    episode = runner.start(Example("1+1=", "2", "sums.csv:3"))
    turn = {"tokens": [ord("2"), EOS], "logprobs": np.zeros(2, np.float32), "policy_version": 0}
    runner.advance(episode, turn)
    runner.advance(episode, turn)
    rewards, counts = episode_rewards("step 5", [[episode]])
    assert rewards.tolist() == [[0.0]] and counts["reward_failures"] == 1
    assert (
        "step 5: a reward of episode 0 (sums.csv:3) failed (error: turn 2: tests.test_entry_errors:broken_reward "
        "raised ZeroDivisionError: division by zero)" in caplog.text
    )
