"""train.grpo's rollout: G episodes per example, sampled turn by turn through the rollout backend (train/rollout.py
sample_turns), each turn's prompt the episode's whole token sequence so far, and the episodes as the learner's
samples (train/batch.py Sample: sampled tokens trained, added tokens masked out). A task without --env is the case
of one turn: its prompt is the task's prompt as the run renders it (plain text, or a user message in the chat
template), its one turn ends it, and its reward is the task's of that turn, the whole step's checked at once
(math-verify's worker pool checks them in parallel); with --env (and --max-turns), the environment's.

Turn 1 of an example's G episodes is one request with n = G (they share the prompt's KV pages), all P examples'
in one rollout call; every later turn is a request of its own whose prompt extends the previous sequence, so the
engine's prefix cache (rlkjax/engine/prefix_cache.py) holds that sequence's full pages and only the new tokens are
prefilled. Seeds: turn t (from 0) of sample j of an example with seed s samples with sample_seed(s, t * G + j);
turn 0's are the n = G request's own.

The context: everything after the first prompt, every turn's sampled and added tokens, fits --max-new-tokens, so
an episode is at most --max-prompt-tokens + --max-new-tokens long (the length the engines' KV caches, the memory
plan and the learner's batch are sized for). Each turn samples up to what is left. An episode ends when its
environment says done, when a turn ends without the eos (it ran out of tokens), after --max-turns turns (a task's
one), or when the environment's next messages would leave no room for a sampled token (they are then not
appended). Its reward is the sum of its steps' rewards.
"""

import dataclasses

import numpy as np

from rlkjax.core.checks import sample_seed
from rlkjax.core.sampling_params import SamplingParams
from rlkjax.rl.environments import Episode, Step, Turn, checked_reset, checked_step, continuation, first_prompt
from rlkjax.text.chat import PromptFormat
from train.batch import Sample
from train.rewards import episode_rewards, group_rewards
from train.rollout import Completion

END_REASONS = ("env", "length", "turns", "context")


@dataclasses.dataclass(frozen=True)
class EpisodeRunner:
    """What turns a group of examples into episodes: a task's own, of one turn (env None), or an environment's."""

    task: object  # rlkjax.rl.tasks: .reward(example, text); its reward scores a one-turn episode
    env: object | None  # rlkjax.rl.environments.Environment (--env), or None: the task's one-turn episodes
    tokenizer: object
    # The run's prompts: a one-turn episode's is render(example.prompt); an environment's turns are rendered with
    # its template (rlkjax.text.chat.ChatTemplate), after its system prompt, with its thinking switch
    render: PromptFormat
    eos: int | None  # the token that ends a turn (the engines' eos; None: none, a task's turn runs to its length)
    max_turns: int  # 1 for a task's episodes
    max_new_tokens: int  # the budget of everything after the first prompt
    max_prompt_tokens: int  # the longest first prompt

    def start(self, example, where: str = "") -> Episode:
        """A new episode of `example`: its first prompt, which must fit max_prompt_tokens. `where` (the trainer's
        step) names the moment in the error if the environment's reset raises
        (rlkjax.rl.environments.EnvironmentFailure)."""
        if self.env is None:
            messages = [{"role": "user", "content": example.prompt}]
            prompt = self.tokenizer.encode(self.render(example.prompt))
        else:
            messages = checked_reset(self.env, example, where)
            if self.render.system_prompt is not None:
                messages = [{"role": "system", "content": self.render.system_prompt}, *messages]
            prompt = first_prompt(self.env, messages, self.render.template, self.tokenizer, **self.template_kwargs)
        if not 0 < len(prompt) <= self.max_prompt_tokens:
            raise ValueError(
                f"{example.source or repr(example.prompt[:80])}: the first prompt is {len(prompt)} tokens; "
                f"--max-prompt-tokens={self.max_prompt_tokens} accepts 1 to {self.max_prompt_tokens}"
            )
        return Episode(example, prompt, list(messages))

    @property
    def template_kwargs(self) -> dict:
        return {"enable_thinking": self.render.enable_thinking}

    def advance(self, episode: Episode, sample: Completion, where: str = "") -> None:
        """Add a sampled turn, ask the environment, and append its messages' tokens or end the episode (a task's
        episode ends after its turn: its reward comes from `rewards`). A step that raises stops here, named with
        `where`, its turn and its example."""
        tokens = list(sample.tokens)
        eos = bool(tokens) and tokens[-1] == self.eos
        text = self.tokenizer.decode(tokens[:-1] if eos else tokens)
        episode.turns.append(Turn(tokens, np.asarray(sample.logprobs, np.float32), text, eos, sample.policy_version))
        episode.messages.append({"role": "assistant", "content": text})
        if self.env is None:
            return self._end(episode, "turns")
        step: Step = checked_step(self.env, episode, where)
        episode.add_step(step)
        if step.done:
            return self._end(episode, "env")
        if not eos:
            return self._end(episode, "length")
        if len(episode.turns) >= self.max_turns:
            return self._end(episode, "turns")
        added = self.tokenizer.encode(continuation(self.render.template, step.messages, **self.template_kwargs))
        if len(episode.completion) + len(added) >= self.max_new_tokens:
            return self._end(episode, "context")
        episode.turns[-1].added = added
        episode.messages += step.messages

    @staticmethod
    def _end(episode: Episode, reason: str) -> None:
        episode.done, episode.ended_by = True, reason

    def left(self, episode: Episode) -> int:
        """Tokens the next turn may sample."""
        return self.max_new_tokens - len(episode.completion)

    def run(self, rollout, examples, seeds, sampling: SamplingParams, where: str = "") -> list[list[Episode]]:
        """[P][G] finished episodes of `examples`; sampling: the first turn's (n = G, max_tokens, temperature);
        `where` (the trainer's step) names the moment in an environment's error."""
        group = sampling.n
        episodes = [[self.start(e, where) for _ in range(group)] for e in examples]
        # every example's G first turns in one rollout call, as n = G requests sharing their prompt's pages
        first = rollout.sample_turns([g[0].prompt for g in episodes], seeds, [sampling] * len(examples))
        for g, samples in zip(episodes, first, strict=True):
            for episode, sample in zip(g, samples, strict=True):
                self.advance(episode, sample, where)
        for turn in range(1, self.max_turns):
            pending = [(i, j) for i, g in enumerate(episodes) for j, ep in enumerate(g) if not ep.done]
            if not pending:
                break
            prompts = [episodes[i][j].tokens for i, j in pending]
            turn_seeds = [sample_seed(seeds[i], turn * group + j) for i, j in pending]
            samplings = [dataclasses.replace(sampling, n=1, max_tokens=self.left(episodes[i][j])) for i, j in pending]
            for (i, j), samples in zip(pending, rollout.sample_turns(prompts, turn_seeds, samplings), strict=True):
                self.advance(episodes[i][j], samples[0], where)
        return episodes

    def rewards(self, where: str, episodes: list[list[Episode]]) -> tuple[np.ndarray, dict]:
        """[P, G] rewards of finished `episodes` and the row's failure counts (train/rewards.py): the environment's
        (each episode's sum of its steps'), or for a task's one-turn episodes the task's of each completion
        (its text, or its token ids for a task that `reads_token_ids`), the whole step's at once. `where` (the
        trainer's step) names the moment in the warnings."""
        if self.env is not None:
            return episode_rewards(where, episodes)
        ids = getattr(self.task, "reads_token_ids", False)
        completions = [[ep.completion if ids else self.tokenizer.decode(ep.completion) for ep in g] for g in episodes]
        return group_rewards(where, self.task, [g[0].example for g in episodes], completions)


def learner_samples(episodes: list[list[Episode]], rewards: np.ndarray, adv: np.ndarray, temperature: float):
    """The learner's rows (train/batch.py Sample), [P][G] episodes flattened: per episode its first prompt, every
    later token, the sampler's logprobs on the sampled ones, the mask (1 sampled, 0 added), its reward and
    advantage."""
    return [
        Sample(
            prompt=ep.prompt,
            tokens=ep.completion,
            logprobs=ep.logprobs,
            mask=ep.mask,
            adv=float(a),
            temperature=temperature,
            reward=float(r),
            turns=len(ep.turns),
            policy_version=ep.turns[0].policy_version,
        )
        for g, rg, ag in zip(episodes, rewards, adv, strict=True)
        for ep, r, a in zip(g, rg, ag, strict=True)
    ]


def episode_row(episodes: list[list[Episode]], before: dict, after: dict) -> dict:
    """The metrics row's multi-turn fields: turns, sampled and added tokens and tool-response turns per episode,
    how episodes ended, and the prefix cache's prefill tokens saved during the rollout (`before`, `after`: the
    rollout's prefix_cache() counters around it)."""
    flat = [ep for g in episodes for ep in g]
    n = len(flat)
    sampled = sum(len(t.sampled) for ep in flat for t in ep.turns)
    added = sum(len(t.added) for ep in flat for t in ep.turns)
    row = {
        "turns_mean": sum(len(ep.turns) for ep in flat) / n,
        "sampled_tokens_mean": sampled / n,
        "env_tokens_mean": added / n,
        "tool_results_mean": sum(m["role"] == "tool" for ep in flat for m in ep.messages) / n,
    }
    row |= {f"ended_by_{r}": sum(ep.ended_by == r for ep in flat) for r in END_REASONS}
    query = after.get("query_tokens", 0) - before.get("query_tokens", 0)
    hit = after.get("hit_tokens", 0) - before.get("hit_tokens", 0)
    row |= {"prefix_cache_hit_tokens": hit, "prefix_cache_query_tokens": query}
    row["prefix_cache_hit_rate"] = hit / query if query else 0.0
    return row
