"""train.grpo's multi-turn rollout (--env, --max-turns): G episodes per example, sampled turn by turn through the
rollout backend (train/rollout.py sample_turns), each turn's prompt the episode's whole token sequence so far, and
the episodes as the learner's samples (sampled tokens trained, added tokens masked out).

Turn 1 of an example's G episodes is one request with n = G (they share the prompt's KV pages, as single-turn
groups do); every later turn is a request of its own whose prompt extends the previous sequence, so the engine's
prefix cache (rlkjax/engine/prefix_cache.py) holds that sequence's full pages and only the new tokens are prefilled.
Seeds: turn t (from 0) of sample j of an example with seed s samples with sample_seed(s, t * G + j); turn 0's are
the n = G request's own, so --max-turns 1 samples what the single-turn rollout samples.

The context: everything after the first prompt, every turn's sampled and added tokens, fits --max-new-tokens, so
an episode is at most --max-prompt-tokens + --max-new-tokens long (the length the engines' KV caches, the memory
plan and the learner's batch are sized for, as in a single-turn run). Each turn samples up to what is left. An
episode ends when its environment says done, when a turn ends without the eos (it ran out of tokens), after
--max-turns turns, or when the environment's next messages would leave no room for a sampled token (they are then
not appended). Its reward is the sum of its steps' rewards.
"""

import dataclasses

import numpy as np

from rlkjax.core.checks import sample_seed
from rlkjax.core.sampling_params import SamplingParams
from rlkjax.rl.environments import Episode, Step, Turn, checked_reset, checked_step, continuation, first_prompt

END_REASONS = ("env", "length", "turns", "context")


@dataclasses.dataclass(frozen=True)
class EpisodeRunner:
    """What turns a group of examples into episodes. template_kwargs go to the chat template (enable_thinking)."""

    env: object  # rlkjax.rl.environments.Environment
    tokenizer: object
    template: object  # rlkjax.text.chat.ChatTemplate
    eos: int  # the token that ends a turn (the engines' eos)
    max_turns: int
    max_new_tokens: int  # the budget of everything after the first prompt
    max_prompt_tokens: int  # the longest first prompt
    system_prompt: str | None = None  # a system message before reset's messages
    template_kwargs: dict = dataclasses.field(default_factory=dict)

    def start(self, example, where: str = "") -> Episode:
        """A new episode of `example`: the environment's first prompt. `where` (the trainer's step) names the
        moment in the error if reset raises (rlkjax.rl.environments.EnvironmentFailure)."""
        messages = checked_reset(self.env, example, where)
        if self.system_prompt is not None:
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        prompt = first_prompt(self.env, messages, self.template, self.tokenizer, **self.template_kwargs)
        if not 0 < len(prompt) <= self.max_prompt_tokens:
            raise ValueError(
                f"{example.source or repr(example.prompt[:80])}: the environment's first prompt is {len(prompt)} "
                f"tokens; --max-prompt-tokens={self.max_prompt_tokens} accepts 1 to {self.max_prompt_tokens}"
            )
        return Episode(example, prompt, list(messages))

    def advance(self, episode: Episode, sample: dict, where: str = "") -> None:
        """Add a sampled turn ({tokens, logprobs, policy_version}), ask the environment, and append its messages'
        tokens or end the episode. A step that raises stops here, named with `where`, its turn and its example."""
        tokens = list(sample["tokens"])
        eos = bool(tokens) and tokens[-1] == self.eos
        text = self.tokenizer.decode(tokens[:-1] if eos else tokens)
        episode.turns.append(
            Turn(tokens, np.asarray(sample["logprobs"], np.float32), text, eos, sample["policy_version"])
        )
        episode.messages.append({"role": "assistant", "content": text})
        step: Step = checked_step(self.env, episode, where)
        episode.add_step(step)
        if step.done:
            return self._end(episode, "env")
        if not eos:
            return self._end(episode, "length")
        if len(episode.turns) >= self.max_turns:
            return self._end(episode, "turns")
        added = continuation(self.template, self.tokenizer, step.messages, after_eos=True, **self.template_kwargs)
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


def learner_samples(episodes: list[list[Episode]], adv: np.ndarray, temperature: float) -> list[dict]:
    """train/batch.py pack's samples: per episode the first prompt, every later token, the sampler's logprobs on
    the sampled ones, the mask (1 sampled, 0 added) and the episode's advantage."""
    return [
        {
            "prompt": ep.prompt,
            "tokens": ep.completion,
            "logprobs": ep.logprobs,
            "mask": ep.mask,
            "adv": float(a),
            "temperature": temperature,
        }
        for g, ag in zip(episodes, adv, strict=True)
        for ep, a in zip(g, ag, strict=True)
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
