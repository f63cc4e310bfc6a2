"""Multi-turn environments: what an episode's first prompt is, and what follows each sampled turn.

One turn of a calculator episode, as train/episodes.py's EpisodeRunner plays each turn, with a checkpoint's
`tokenizer` and chat `template` (rlkjax.text.tokenizer.load_tokenizer, rlkjax.text.chat.load_chat_template):

    >>> from rlkjax.rl.tasks import make_task
    >>> env = CalculatorEnvironment(make_task("arithmetic"))  # or load_environment("calculator" or "mod:Class", task)
    >>> example = Example("1234*5678=", answer="7006652")
    >>> messages = env.reset(example)  # the first prompt, as chat messages
    >>> episode = Episode(example, first_prompt(env, messages, template, tokenizer), messages)
    >>> text = '<tool_call>\\n{"name": "calculator", "arguments": {"expression": "1234*5678"}}\\n</tool_call>'
    >>> sampled = tokenizer.encode(text + "<|im_end|>")  # the turn the sampler drew from episode.tokens
    >>> episode.turns.append(Turn(sampled, np.zeros(len(sampled), np.float32), text, eos=True))  # + its logprobs
    >>> episode.messages.append({"role": "assistant", "content": text})
    >>> step = env.step(episode)  # Step(messages to append, reward, done)
    >>> step
    Step(messages=[{'role': 'tool', 'content': '7006652', 'name': 'calculator'}], reward=0.0, done=False)
    >>> episode.add_step(step)
    >>> episode.turns[-1].added = continuation(template, tokenizer, step.messages, after_eos=True)
    >>> episode.messages += step.messages
    >>> episode.tokens == episode.prompt + sampled + episode.turns[-1].added  # the next turn's prompt
    True

An episode is ONE token sequence: the first prompt's tokens, then each turn's sampled tokens (trained on, their
logprobs the sampler's) and the tokens the environment and the chat template add after it (tool results, user
turns, the next generation prompt: conditioned on, never trained on). Nothing is re-tokenised: turn k + 1's
prompt is exactly the tokens of turns 1 ... k plus the new added tokens, so the sampler's recorded logprobs are
the learner's logprobs of the same sequence (the numerics contract covers every sampled token of every turn),
and the engine's prefix cache finds each turn's prompt already computed up to its last full page.

Qwen3's `<think>` blocks: rendering a whole conversation, Qwen3's chat template drops the `<think>...</think>`
reasoning of the assistant turns before the last user query (a tool response is not a query: within one query
it keeps them). Here the conversation is never rendered again: the sampled tokens stay in the sequence exactly
as sampled (reasoning included, so later turns condition on it), and only the NEW messages are rendered, as the
template renders a continuation (the text after an assistant turn's `<|im_end|>`: a newline, the new turns, then
the generation prompt), and appended. A later turn therefore sees what the model wrote, not the shortened history
a re-rendered prompt would show; the loss trains what was sampled, in the context it was sampled in.

Why in rlkjax and not train/: an environment is host code over rlkjax's tools, chat templates and rewards,
useful to any driver (train.grpo's rollouts, or an outside trainer speaking to the server's token route); the
loop that samples turns through the rollout backends is train/episodes.py.
"""

import dataclasses
import importlib
from typing import NamedTuple

import numpy as np

from rlkjax.rl.data import Example
from rlkjax.rl.rewards import RewardResult, checked_reward
from rlkjax.rl.tools import Tools, tool_messages


class Step(NamedTuple):
    """What an environment answers to a sampled turn. reward: a float, or a RewardResult (rlkjax.rl.rewards) whose
    failure the trainer counts and reports; an episode's reward is the sum of its steps' rewards."""

    messages: list  # chat messages to append (rendered as the template's continuation), [] when done
    reward: float | RewardResult
    done: bool


@dataclasses.dataclass
class Turn:
    """One sampled turn and what the environment added after it."""

    sampled: list[int]
    logprobs: np.ndarray  # float32, one per sampled token: the sampler's
    text: str  # the sampled tokens decoded (the eos left out)
    eos: bool  # the turn ended with the eos token (else it ran out of tokens)
    policy_version: int = 0
    added: list[int] = dataclasses.field(default_factory=list)  # the environment's and template's tokens after it


@dataclasses.dataclass
class Episode:
    """One episode's sequence: `prompt` (the first prompt's tokens), then per turn its sampled and added tokens.
    `messages` is the conversation as messages (reset's, each turn's text as an assistant message, each step's);
    it is for environments to read, never rendered again."""

    example: Example
    prompt: list[int]
    messages: list
    turns: list[Turn] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    failures: list = dataclasses.field(default_factory=list)  # RewardResults with a failure
    done: bool = False
    ended_by: str = ""  # "env" (the environment said done), "length" (a turn ran out of tokens), "turns", "context"

    @property
    def tokens(self) -> list[int]:
        """The whole sequence: the next turn's prompt."""
        out = list(self.prompt)
        for t in self.turns:
            out += t.sampled + t.added
        return out

    @property
    def completion(self) -> list[int]:
        """Every token after the first prompt."""
        return self.tokens[len(self.prompt) :]

    @property
    def mask(self) -> np.ndarray:
        """[len(completion)] float32: 1 on sampled tokens (trained), 0 on added ones."""
        return np.concatenate(
            [np.zeros(0, np.float32)]
            + [np.r_[np.ones(len(t.sampled), np.float32), np.zeros(len(t.added), np.float32)] for t in self.turns]
        )

    @property
    def logprobs(self) -> np.ndarray:
        """[len(completion)] float32: the sampler's logprob on sampled tokens, 0 on added ones."""
        return np.concatenate(
            [np.zeros(0, np.float32)]
            + [np.r_[np.asarray(t.logprobs, np.float32), np.zeros(len(t.added), np.float32)] for t in self.turns]
        ).astype(np.float32)

    def add_step(self, step: Step) -> None:
        reward = step.reward if isinstance(step.reward, RewardResult) else RewardResult(float(step.reward))
        self.reward += reward.reward
        if reward.failure is not None:  # reported with the turn it rewarded
            self.failures.append(dataclasses.replace(reward, detail=f"turn {len(self.turns)}: {reward.detail}"))


class EnvironmentFailure(Exception):
    """An environment's code raised (its constructor, reset or step). The message names where (the trainer's step),
    the environment's class and method, the example (its data file and line) and the turn, and the exception; that
    exception is the __cause__, so its traceback stays for whoever debugs the environment."""


def example_name(example: Example) -> str:
    """An example as errors name it: its data file and line, else its prompt's start."""
    return f"example {example.source}" if example.source else f"example {example.prompt[:80]!r}"


def _class_name(env) -> str:
    return f"{type(env).__module__}.{type(env).__qualname__}"


def _failure(where: str, what: str, error: Exception) -> EnvironmentFailure:
    detail = str(error).strip()
    return EnvironmentFailure(
        f"{where + ': ' if where else ''}{what}: {type(error).__name__}{': ' * bool(detail)}{detail}"
    )


def checked_reset(env, example: Example, where: str = "") -> list[dict]:
    """env.reset(example); whatever it raises comes back as an EnvironmentFailure naming `where`, the environment's
    class, the example and the exception."""
    try:
        return env.reset(example)
    except Exception as e:
        raise _failure(where, f"{_class_name(env)}.reset raised on {example_name(example)}", e) from e


def checked_step(env, episode: Episode, where: str = "") -> Step:
    """env.step(episode) after the episode's latest turn; whatever it raises comes back as an EnvironmentFailure
    naming `where`, the environment's class, the example, the turn (from 1) and the exception."""
    try:
        return env.step(episode)
    except Exception as e:
        what = f"{_class_name(env)}.step raised on turn {len(episode.turns)} of {example_name(episode.example)}"
        raise _failure(where, what, e) from e


class Environment:
    """The interface, and the plainest environment: the example's prompt as one user message, one turn, the
    task's reward of that turn's text (train.grpo's single-turn task as an environment).

    Subclasses override `reset` and `step`; `tools` (schemas, Tools.schemas()) are listed by the chat template in
    the first prompt. Built with the run's task: `Class(task)`."""

    tools: list | None = None

    def __init__(self, task):
        self.task = task

    def reset(self, example: Example) -> list[dict]:
        """The first prompt's messages."""
        return [{"role": "user", "content": example.prompt}]

    def step(self, episode: Episode) -> Step:
        """After each sampled turn (episode.turns[-1]): the messages to append, the turn's reward, whether done."""
        return Step([], checked_reward(self.task, episode.example, episode.turns[-1].text), True)


class CalculatorEnvironment(Environment):
    """The model may call the `calculator` tool (rlkjax.rl.tools; listed in the system turn by the chat template).
    A turn with `<tool_call>` blocks gets their results as a `<tool_response>` turn (a malformed block, an unknown
    tool, bad arguments, a raising or slow tool: an "Error: ..." observation the model reads); a turn without one
    ends the episode, rewarded by the task's check of that turn's text (math-verify of its \\boxed{} answer for
    --task math). Intermediate turns earn 0."""

    def __init__(self, task, tools: Tools | None = None):
        super().__init__(task)
        self.registry = tools or Tools()
        self.tools = self.registry.schemas()

    def step(self, episode: Episode) -> Step:
        _, calls, results = self.registry.run_text(episode.turns[-1].text)
        if not calls:
            return Step([], checked_reward(self.task, episode.example, episode.turns[-1].text), True)
        return Step(tool_messages(results, calls), 0.0, False)


BUILT_IN = {"single": Environment, "calculator": CalculatorEnvironment}


def load_environment(spec: str, task) -> Environment:
    """A built-in by name (single, calculator) or `module:Class`, built as Class(task). ValueError says why not."""
    if spec in BUILT_IN:
        return BUILT_IN[spec](task)
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"--env {spec!r}: choose {', '.join(BUILT_IN)} or module:Class")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--env {spec!r}: {e}") from None
    try:
        env = cls(task)
    except Exception as e:
        raise _failure("", f"--env {spec!r}: {name}(task) raised", e) from e
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise ValueError(f"--env {spec!r}: {name} has no {method}() method")
    return env


def first_prompt(env: Environment, messages: list, template, tokenizer, **kwargs) -> list[int]:
    """The first prompt's tokens: reset's messages and the environment's tools rendered with the generation
    prompt. kwargs go to the template (enable_thinking=False, ...)."""
    return tokenizer.encode(template.render(messages, add_generation_prompt=True, tools=env.tools, **kwargs))


def continuation(template, tokenizer, messages: list, after_eos: bool, **kwargs) -> list[int]:
    """The tokens that follow a sampled assistant turn when `messages` are appended: the template's rendering of
    the new messages alone, up to the next generation prompt, after the newline the template writes after an
    assistant turn's eos (`after_eos`). With Qwen3's template that is "\\n<|im_start|>user\\n<tool_response>\\n...
    </tool_response><|im_end|>\\n<|im_start|>assistant\\n" for tool results (as rlkjax.rl.tools.tool_turn) and
    "\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n" for a user message."""
    text = template.render(messages, add_generation_prompt=True, **kwargs)
    return tokenizer.encode(("\n" if after_eos else "") + text)


def worked_episode(template, tokenizer, turns: list, eos: int, **kwargs) -> tuple[list[int], list[int]]:
    """A written episode after its first prompt (chat messages: assistant turns, and the tool results or user
    turns between them) as tokens, assembled as a sampled one is: each assistant turn's content + eos (mask 1),
    each run of other messages as the template's continuation (mask 0). -> (tokens, mask). For a supervised
    warm-up on the sequences the rollout will sample (train.sft --env)."""
    if not turns or turns[0].get("role") != "assistant" or turns[-1].get("role") != "assistant":
        raise ValueError("turns must start and end with an assistant message")
    tokens, mask, i = [], [], 0
    while i < len(turns):
        if turns[i].get("role") == "assistant":
            ids, trained, i = tokenizer.encode(turns[i]["content"]) + [eos], 1, i + 1
        else:
            j = next((k for k in range(i, len(turns)) if turns[k].get("role") == "assistant"), len(turns))
            ids, trained, i = continuation(template, tokenizer, turns[i:j], after_eos=True, **kwargs), 0, j
        tokens += ids
        mask += [trained] * len(ids)
    return tokens, mask
