"""Errors a user can act on. A run refused at start by `python -m train.grpo`, `train.sft` or `serve.rollout` (a
bad flag, a missing or malformed model, tokenizer, template, data or key file, an --env that does not import, a
port taken, a memory plan that cannot fit) prints one message naming the flag or file and exits with status 2,
without a traceback; an environment whose reset or step raises stops train.grpo with a headline naming the step,
the environment's class, the example's file and line, the turn and the exception, then the environment's own
traceback; a reward that raises is reported with the reward's name; a `tool` message without tool_call_id is a
400. The subprocess runs stop before anything compiles (a few seconds each)."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tyro

from rlkjax.core.checkpoint import load_hf_checkpoint
from rlkjax.core.config import ModelConfig
from rlkjax.entry_config import Refusal, exit_plainly
from rlkjax.rl.data import Example
from rlkjax.rl.environments import Environment, EnvironmentFailure, Step, load_environment
from rlkjax.rl.rewards import checked_reward
from rlkjax.rl.tasks import make_task
from rlkjax.text.chat import DEFAULT_TEMPLATE, ChatTemplate, prompt_format
from rlkjax.text.tokenizer import ByteTokenizer, load_tokenizer
from serve.http import BadRequest
from serve.protocol import ChatCompletionRequest, Limits
from tests.helpers import EOS
from tests.test_episodes import COMPACT, ask_again_run
from train import grpo
from train.config import GRPOConfig
from train.episodes import EpisodeRunner
from train.rewards import episode_rewards

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "fixtures" / "hf_qwen3_tied"  # config.json + model.safetensors, no tokenizer


class RaisingReset(Environment):
    def reset(self, example):
        raise KeyError("hint")


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


def run_entry(module: str, *args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"}
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def assert_refused(result: subprocess.CompletedProcess, prog: str, *parts: str) -> str:
    """Exit status 2, no traceback, and the last line `prog: message` holding every part."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith(f"{prog}: "), result.stderr[-3000:]
    for part in parts:
        assert part in message, message
    return message


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


@pytest.mark.parametrize(
    "args, parts",
    [
        (["--model", "/nonexistent/model"], ["'/nonexistent/model' is neither a preset"]),
        (["--model", "{bad}/bad_weights"], ["bad_weights/model.safetensors: not a readable safetensors file"]),
        (["--learner-devices", "9"], ["--learner-devices='9': device 9 does not exist"]),
        (["--compilation-cache", "/proc/no/such/dir"], ["--compilation-cache='/proc/no/such/dir': cannot create"]),
    ],
)
def test_train_grpo_refusals_exit_2_without_a_traceback(args, parts, bad_files, tmp_path):
    """`python -m train.grpo` itself, one run per kind of refusal: a loader's, a malformed file's, a device's (once
    JAX is up), the compilation cache's (before anything loads)."""
    args = [a.replace("{bad}", str(bad_files)) for a in args]
    result = run_entry("train.grpo", *args, "--out", str(tmp_path / "run"), "--no-progress")
    assert_refused(result, "train.grpo", *parts)


@pytest.mark.parametrize(
    "args, parts",
    [
        (["--model", "{bad}/bad_tokenizer"], ["bad_tokenizer/tokenizer.json: not a tokenizer"]),
        (["--model", str(TINY)], ["has no tokenizer.json", "--tokenizer"]),
        (["--chat-template", "{bad}/template.jinja"], ["template.jinja: not a valid Jinja template (line 1"]),
        (["--task", "gsm8k", "--data", "{bad}/missing.jsonl"], ["missing.jsonl: cannot read the data file"]),
        (["--env", "no_such_module:Env", "--chat-template", "{bad}/compact.jinja"], ["--env 'no_such_module:Env'"]),
        (["--env", "calculator"], ["--env 'calculator' needs a chat template", "--chat-template"]),
        (["--max-new-tokens", "2000"], ["--max-new-tokens = 2128 exceeds the model's context of 1024"]),
    ],
)
def test_train_grpo_refusals_in_process(args, parts, bad_files, tmp_path, capsys):
    """More of train.grpo's refusals, through the same exit_plainly its main uses, in this process (main itself
    would also switch this process's compilation cache): status 2, one line `train.grpo: message`."""
    args = [a.replace("{bad}", str(bad_files)) for a in args]
    with pytest.raises(SystemExit) as stop, exit_plainly("train.grpo"):
        grpo.train(tyro.cli(GRPOConfig, args=[*args, "--out", str(tmp_path / "run"), "--no-progress"]))
    assert stop.value.code == 2
    message = capsys.readouterr().err
    assert message.startswith("train.grpo: ") and message.count("\n") == 1, message
    for part in parts:
        assert part in message, message


@pytest.mark.parametrize("args, part", [(["--group-size", "1"], "--group-size=1 must be >= 2")])
def test_train_grpo_parser_errors_exit_2_without_a_traceback(args, part):
    """What the parser (tyro) refuses, a flag it cannot read or a config's __post_init__ check: its own message
    box, status 2."""
    result = run_entry("train.grpo", *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert part in result.stderr


def test_train_grpo_refuses_an_out_with_an_earlier_runs_checkpoints(tmp_path):
    (tmp_path / "run" / "checkpoints" / "3").mkdir(parents=True)
    result = run_entry("train.grpo", "--out", str(tmp_path / "run"), "--steps", "1", "--no-progress")
    assert_refused(result, "train.grpo", "already holds checkpoints [3] of an earlier run", "--resume")


def test_train_sft_refusals_exit_2_without_a_traceback(bad_files, tmp_path):
    data = str(bad_files / "problems.jsonl")
    out = ["--out", str(tmp_path / "sft")]
    missing = run_entry("train.sft", "--data", data, *out)  # --model is required: the parser's error
    assert missing.returncode == 2 and "Traceback" not in missing.stderr and "--model" in missing.stderr
    assert_refused(
        run_entry("train.sft", "--model", str(bad_files / "bad_weights"), "--data", data, *out),
        "train.sft",
        "bad_weights/model.safetensors: not a readable safetensors file",
    )


def test_serve_rollout_refusals_exit_2_without_a_traceback(bad_files, tmp_path):
    assert_refused(
        run_entry("serve.rollout", "--admin-key-file", str(tmp_path / "no_key"), "--no-warmup"),
        "serve.rollout",
        "--admin-key-file",
        "cannot read it (No such file or directory)",
    )
    with socket.socket() as taken:  # a port something else listens on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_entry("serve.rollout", "--port", str(port), "--no-warmup", "--compilation-cache", "off")
    assert_refused(result, "serve.rollout", f"--port {port}: cannot listen there", "address already in use")


def test_memory_plan_refusal_is_a_refusal(monkeypatch):
    """A run the plan fits no setting of is refused by train.grpo's plan_memory as a Refusal (so main prints it and
    exits with status 2), naming every phase: Qwen3-8B on a device that lets JAX take 1 GiB."""
    import jax

    monkeypatch.setattr(grpo, "memory_limit", lambda devices: 2**30)
    config = GRPOConfig(prompts_per_step=8, group_size=8, max_new_tokens=256, max_prompt_tokens=128)
    devices = jax.devices()[:1]
    with pytest.raises(Refusal, match="needs more memory than .* lets JAX take") as refused:
        grpo.plan_memory(config, ModelConfig.preset("qwen3-8b"), devices, devices)
    assert all(phase in str(refused.value) for phase in ("rollout", "learner step", "optimiser update"))
    assert "no setting of --moments, --remat and --micro-batch-tokens fits" in str(refused.value)


def test_env_whose_reset_raises_stops_train_grpo_with_its_traceback(bad_files, tmp_path):
    """An environment whose reset raises stops train.grpo before step 1 (every example's first prompt is made at
    the start): the headline names the moment, the class, the example's file and line and the exception, then
    the environment's own traceback (its file and line), exit status 1."""
    data = str(bad_files / "problems.jsonl")
    flags = ["--task", "gsm8k", "--data", data, "--chat-template", str(bad_files / "compact.jinja")]
    result = run_entry("train.grpo", *flags, "--env", "tests.test_entry_errors:RaisingReset", "--out", str(tmp_path))
    assert result.returncode == 1, result.stderr[-3000:]
    headline, rest = result.stderr.split("\n", 1)[0], result.stderr.split("\n", 1)[1]
    assert headline == (
        "train.grpo: before step 1, checking every example's first prompt: tests.test_entry_errors.RaisingReset.reset "
        f"raised on example {data}:1: KeyError: 'hint'"
    )
    assert rest.startswith("\nThe environment's traceback:\nTraceback (most recent call last):\n"), rest
    assert 'test_entry_errors.py", line' in rest and rest.rstrip().endswith("KeyError: 'hint'")
    assert rest.count("Traceback") == 1  # the environment's alone, not the trainer's around it


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


def test_a_tool_message_needs_its_tool_call_id():
    """/v1/chat/completions: a `tool` message without tool_call_id is a 400 naming the field, as OpenAI's API
    answers; with one it renders."""
    limits = Limits(vocab_size=512, max_context=1024, max_batch=8, max_prompts=8)
    template, tokenizer = ChatTemplate(DEFAULT_TEMPLATE, {}), ByteTokenizer()
    call = {"id": "call-1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
    history = [{"role": "user", "content": "6*7?"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    answered = {"messages": [*history, {"role": "tool", "tool_call_id": "call-1", "content": "42"}], "max_tokens": 2}
    ChatCompletionRequest.parse(answered, limits, tokenizer, template, "qwen3-tiny")
    for tool in ({"role": "tool", "content": "42"}, {"role": "tool", "tool_call_id": None, "content": "42"}):
        with pytest.raises(BadRequest, match=r"messages\[2\].tool_call_id is required"):
            ChatCompletionRequest.parse(
                {"messages": [*history, tool], "max_tokens": 2}, limits, tokenizer, template, "qwen3-tiny"
            )
