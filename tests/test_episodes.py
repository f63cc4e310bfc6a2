"""Multi-turn episodes: one token sequence per episode, assembled turn by turn with the real Qwen3 tokenizer and
chat template and never re-tokenised (earlier turns' <think> blocks kept as sampled); bad tool calls as
observations; the context budget and the other ends of an episode; the learner's mask (tokens the environment
and template add are never trained or scored); one advantage per episode; the metrics row's multi-turn fields;
and train.grpo --env on the real engine with every sampled token of every turn on the contract."""

import json

import jax
import numpy as np
import pytest

from rlkjax.entry_config import ModelSource
from rlkjax.rl.environments import CalculatorEnvironment, Environment, Step, load_environment
from rlkjax.rl.tasks import make_task
from rlkjax.rl.tools import Tools, tool_turn
from rlkjax.text.chat import load_chat_template
from rlkjax.text.tokenizer import load_tokenizer
from rlkjax.tiny_qwen3 import write_tiny_qwen3
from tests.helpers import EOS, assert_bits_equal, eos_model
from train import grpo
from train.batch import pack
from train.config import GRPOConfig, Optimiser
from train.episodes import EpisodeRunner, episode_row, learner_samples

IM_END, TOOL_CALL, TOOL_RESPONSE = 151645, 151657, 151665
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(tokenizer, template, a math task of one product) with Qwen3's real tokenizer and chat template."""
    directory = write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))
    data = directory / "problems.jsonl"
    data.write_text(json.dumps({"prompt": "What is 1234 * 5678? Put the answer in \\boxed{}.", "answer": "7006652"}))
    tokenizer = load_tokenizer(directory)
    return tokenizer, load_chat_template(tokenizer), make_task("math", str(data))


def runner(qwen, env=None, max_turns=4, max_new_tokens=400, **tools):
    tokenizer, template, task = qwen
    env = env or CalculatorEnvironment(task, **tools)
    return EpisodeRunner(env, tokenizer, template, IM_END, max_turns, max_new_tokens, 400)


def sampled(tokenizer, text, eos=True):
    """A turn as the rollout returns it: the text's ids (+ eos), made-up logprobs that name each position."""
    tokens = tokenizer.encode(text) + ([IM_END] if eos else [])
    return {"tokens": tokens, "logprobs": -np.arange(1, len(tokens) + 1, dtype=np.float32), "policy_version": 0}


def test_an_episode_is_the_concatenation_of_sampled_and_added_tokens(qwen):
    """Turn k + 1's prompt is turn k's prompt + its sampled tokens + the tokens the environment and template added
    (a tool's result as a <tool_response> turn), exactly; the sampled tokens stay as sampled, <think> block
    included, where rendering the whole conversation again with Qwen3's template drops the earlier turn's
    reasoning once a user turn follows (a re-rendered prompt would change the context under the recorded
    logprobs)."""
    tokenizer, template, task = qwen
    run = runner(qwen)
    (example,) = task.examples
    episode = run.start(example)
    assert episode.prompt == tokenizer.encode(template.render(episode.messages, tools=Tools().schemas()))
    turn1 = sampled(tokenizer, "<think>\nToo big to do by heart.\n</think>\n\n" + CALL.format("1234 * 5678"))
    run.advance(episode, turn1)
    assert not episode.done and len(episode.turns) == 1
    added = tokenizer.encode(tool_turn(template, ["7006652"], enable_thinking=True))
    assert episode.turns[0].added == added and TOOL_RESPONSE in added
    prompt2 = episode.tokens
    assert prompt2 == episode.prompt + turn1["tokens"] + added  # the next turn's prompt
    turn2 = sampled(tokenizer, "<think>\nThe tool said 7006652.\n</think>\n\nSo \\boxed{7006652}")
    run.advance(episode, turn2)
    assert episode.done and episode.ended_by == "env" and episode.reward == 1.0
    assert episode.tokens == prompt2 + turn2["tokens"] and episode.tokens[: len(prompt2)] == prompt2
    assert episode.completion == turn1["tokens"] + added + turn2["tokens"]
    np.testing.assert_array_equal(
        episode.mask, [1] * len(turn1["tokens"]) + [0] * len(added) + [1] * len(turn2["tokens"])
    )
    lp = episode.logprobs
    assert lp.dtype == np.float32 and np.all(lp[episode.mask == 0] == 0)
    np.testing.assert_array_equal(lp[episode.mask == 1], np.r_[turn1["logprobs"], turn2["logprobs"]])
    # Within one query Qwen3's template keeps the reasoning of the turns after it; once a user turn follows,
    # re-rendering drops it: a different sequence from the one sampled, which an episode never becomes.
    follow_up = [*episode.messages, {"role": "user", "content": "And 2 * 3?"}]
    assert "Too big to do by heart" in template.render(episode.messages, tools=Tools().schemas())
    assert "Too big to do by heart" not in template.render(follow_up, tools=Tools().schemas())
    again = tokenizer.encode(template.render(follow_up[-1:], add_generation_prompt=True))
    assert "Too big to do by heart" in tokenizer.decode(episode.tokens + [198] + again)  # 198: "\n"
    assert "Too big to do by heart" in tokenizer.decode(episode.tokens)


@pytest.mark.parametrize(
    "turn, observation",
    [
        ("<tool_call>\n{not json}\n</tool_call>", "Error: the tool call is not valid JSON"),
        ('<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>', "Error: unknown tool 'search'"),
        ('<tool_call>\n{"name": "calculator", "arguments": {"expr": "1"}}\n</tool_call>', "missing argument"),
        (CALL.format("1 / 0"), "Error: calculator failed: ValueError: division by zero"),
        (CALL.format("__import__('os')"), "Error: calculator failed: ValueError"),
        ('<tool_call>\n{"name": "slow", "arguments": {}}\n</tool_call>', "Error: slow ran past its time limit"),
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*', "Error: the tool call is not valid"),
    ],
)
def test_bad_tool_calls_are_observations_the_model_reads(qwen, turn, observation):
    """A malformed block, an unknown tool, bad arguments, a raising, refused or slow tool: the episode goes on
    with an "Error: ..." <tool_response> in its tokens, never an exception."""
    tokenizer, _, task = qwen
    tools = Tools()
    tools.register(lambda: __import__("time").sleep(5), name="slow", timeout=0.05)
    run = runner(qwen, tools=tools)
    episode = run.start(task.examples[0])
    run.advance(episode, sampled(tokenizer, turn))
    assert not episode.done and episode.reward == 0.0
    (message,) = [m for m in episode.messages if m["role"] == "tool"]
    assert message["content"].startswith("Error:") and observation in message["content"]
    assert observation in tokenizer.decode(episode.turns[0].added)


def test_an_episode_ends_at_its_turns_budget_and_length(qwen):
    """--max-turns ends an episode calling tools; a turn without the eos (out of tokens) ends it; tool results
    that would leave no room for a sampled token are not appended (the context budget); the reward stands."""
    tokenizer, _, task = qwen
    call = CALL.format("2 * 3")
    ends = {}
    for name, kwargs, turn in (
        ("turns", dict(max_turns=1), sampled(tokenizer, call)),
        ("length", dict(), sampled(tokenizer, call, eos=False)),
        ("context", dict(max_new_tokens=len(sampled(tokenizer, call)["tokens"]) + 5), sampled(tokenizer, call)),
    ):
        run = runner(qwen, **kwargs)
        episode = run.start(task.examples[0])
        run.advance(episode, turn)
        ends[name] = episode
        assert episode.done and episode.ended_by == name and episode.reward == 0.0
        assert episode.turns[0].added == [] and np.all(episode.mask == 1)
    row = episode_row([[ends["turns"], ends["length"]], [ends["context"], ends["context"]]], {}, {})
    assert row["turns_mean"] == 1 and row["env_tokens_mean"] == 0 and row["tool_results_mean"] == 0
    assert (row["ended_by_turns"], row["ended_by_length"], row["ended_by_context"], row["ended_by_env"]) == (1, 1, 2, 0)


def test_the_learner_never_trains_env_tokens_and_advantages_are_per_episode(qwen):
    """pack puts the sampler's logprobs and mask 1 at the columns predicting sampled tokens only, every turn's;
    the columns the loss scores are exactly those (added tokens are neither trained nor scored). Each
    episode's every sampled token carries its episode's advantage: rewards 1, 0 in a group of two -> +1, -1."""
    tokenizer, _, task = qwen
    run = runner(qwen)
    good, bad = run.start(task.examples[0]), run.start(task.examples[0])
    for episode, answer in ((good, "7006652"), (bad, "7006653")):
        run.advance(episode, sampled(tokenizer, CALL.format("1234*5678")))
        run.advance(episode, sampled(tokenizer, f"\\boxed{{{answer}}}"))
    rewards = np.array([[good.reward, bad.reward]])
    assert rewards.tolist() == [[1.0, 0.0]]
    adv = grpo.group_advantages(rewards)
    samples = learner_samples([[good, bad]], adv, 1.0)
    batch = pack(samples)
    for i, episode in enumerate((good, bad)):
        first = len(episode.prompt) - 1
        want = first + np.flatnonzero(episode.mask)
        assert np.flatnonzero(batch.mask[i]).tolist() == want.tolist()
        assert sorted(c for c in batch.columns[i] if c >= 0) == want.tolist()
        sampled_ids = [t for turn in episode.turns for t in turn.sampled]
        assert batch.tokens[i, want + 1].tolist() == sampled_ids  # column t predicts token t + 1
        np.testing.assert_array_equal(batch.logp_old[i, want], episode.logprobs[episode.mask == 1])
        added = first + np.flatnonzero(episode.mask == 0)
        assert len(added) > 0 and np.all(batch.mask[i, added] == 0) and np.all(batch.logp_old[i, added] == 0)
    np.testing.assert_allclose(batch.adv, [1.0, -1.0], rtol=1e-5)


def test_env_flags_are_checked():
    with pytest.raises(ValueError, match="--max-turns=3 needs --env"):
        GRPOConfig(max_turns=3)
    with pytest.raises(ValueError, match="--ignore-eos"):
        GRPOConfig(env="calculator", ignore_eos=True)
    with pytest.raises(ValueError, match="--max-turns=0 must be positive"):
        GRPOConfig(env="calculator", max_turns=0)
    with pytest.raises(ValueError, match="choose single, calculator or module:Class"):
        load_environment("nope", None)
    with pytest.raises(ValueError, match="No module named"):
        load_environment("no_such_module:Env", None)
    assert isinstance(load_environment("tests.test_episodes:AskAgain", None), AskAgain)


class AskAgain(Environment):
    """Asks "?" after each turn until the third; each turn earns the fraction of its letters that are lowercase."""

    def reset(self, example):
        return [{"role": "user", "content": example.prompt}]

    def step(self, episode):
        text = episode.turns[-1].text
        reward = sum("a" <= c <= "z" for c in text) / max(len(text), 1)
        return Step([{"role": "user", "content": "?"}], reward, len(episode.turns) >= 3)


# A compact ChatML-like template for the byte tokenizer: short prompts and short turn wrappers.
COMPACT = "{% for m in messages %}{{ m['role'][0] + ':' + m['content'] + '\\n' }}{% endfor %}"
COMPACT += "{% if add_generation_prompt %}{{ 'a:' }}{% endif %}"


def ask_again_run(tmp_path, **flags) -> dict:
    """train.grpo's config for AskAgain episodes: the tiny model that draws eos often, the byte tokenizer, the
    compact template, 3 turns of P2 x G4 in a 40-token budget; `flags` add to it."""
    template = tmp_path / "template.jinja"
    template.write_text(COMPACT)
    return dict(
        source=ModelSource(eos_model(tmp_path / "model"), tokenizer="bytes"),
        chat_template=str(template),
        env="tests.test_episodes:AskAgain",
        max_turns=3,
        checkpoint_every=0,
        prompts_per_step=2,
        group_size=4,
        max_new_tokens=40,
        max_prompt_tokens=24,
        progress=False,
        **flags,
    )


def test_grpo_env_trains_every_turn_with_zero_mismatch(tmp_path, monkeypatch):
    """train.grpo --env on the real engine and learner (the tiny model that draws eos often, the byte tokenizer,
    a compact chat template): episodes of several turns, each turn a new request extending the previous
    sequence (the prefix cache saves prefill), the first update's logp_new equal in bits to every sampled token
    of every turn (and the verify pass), the environment's tokens masked out."""
    seen = []
    original = grpo.pack

    def pack_and_keep(samples):
        seen.append(samples)
        return original(samples)

    monkeypatch.setattr(grpo, "pack", pack_and_keep)
    config = GRPOConfig(**ask_again_run(tmp_path, steps=1, out=str(tmp_path / "run")))
    (row,) = grpo.train(config)["history"]
    assert row["tokens_bits_differ"] == 0 and row["first_update_tokens_compared"] == row["tokens_compared"]
    assert row["turns_mean"] > 1.5 and row["env_tokens_mean"] > 0 and row["prefix_cache_hit_tokens"] > 0
    (samples,) = seen
    assert sum(int(np.sum(s["mask"])) for s in samples) == row["tokens_compared"]
    assert row["completion_tokens_mean"] == row["sampled_tokens_mean"]
    for s in samples:
        added = np.flatnonzero(s["mask"] == 0)
        # every added run starts after an eos-ended turn with the template's "\n" and ends with "a:"
        if len(added):
            assert s["tokens"][added[0] - 1] == EOS and s["tokens"][added[0]] == ord("\n")
            assert bytes(s["tokens"][i] for i in added[-2:]) == b"a:"


@pytest.mark.slow  # two short runs
def test_evaluation_runs_episodes_and_leaves_training_unchanged(tmp_path):
    """--eval-data with --env evaluates whole episodes through the environment, and training's bits are the same
    as the run's without evaluation (its episodes fill the prefix cache, whose hits keep every bit)."""
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(3)))
    base = ask_again_run(tmp_path, task="math", data=str(problems), steps=2)
    with_eval = grpo.train(GRPOConfig(out=str(tmp_path / "e"), eval_data=str(problems), eval_every=1, **base))
    without = grpo.train(GRPOConfig(out=str(tmp_path / "n"), **base))
    rows = with_eval["history"]
    assert [r["step"] for r in rows] == [0, 1, 2] and all("eval_pass@4" in r for r in rows)
    for r in rows:
        assert 0 <= r["eval_pass@1"] <= r["eval_pass@4"] <= 1 and r["eval_reward_failures"] == 0
    for a, b in zip(rows[1:], without["history"], strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["loss"] == b["loss"] and a["tokens_bits_differ"] == 0
    for a, b in zip(jax.tree.leaves(with_eval["master"]), jax.tree.leaves(without["master"]), strict=True):
        assert_bits_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # starts a server (its programs compile in its own process)
def test_local_and_remote_rollouts_give_the_same_episodes(tmp_path):
    """The in-process engine and a server on loopback (vLLM's token route), same weights, examples and seeds: the
    same episodes, every turn's tokens and logprob bits; both prefill later turns from the prefix cache."""
    from rlkjax.core.checkpoint import load_hf_checkpoint
    from rlkjax.core.sampling_params import SamplingParams
    from rlkjax.rl.tasks import LowercaseTask
    from rlkjax.text.chat import ChatTemplate
    from rlkjax.text.tokenizer import ByteTokenizer
    from tests.helpers import assert_bits_equal
    from tests.server_process import ADMIN, start_server
    from train import fsdp, rollout

    model_dir = eos_model(tmp_path / "model")
    cfg, params = load_hf_checkpoint(model_dir)
    devices = fsdp.pick_devices("learner_devices", "0")
    local = rollout.LocalRollout(
        params, cfg, "strict", fsdp.make_mesh(devices), devices, rows=8, max_length=64, group=4, eos_token_id=EOS
    )
    run = EpisodeRunner(AskAgain(None), ByteTokenizer(), ChatTemplate(COMPACT, {}), EOS, 3, 40, 24)
    examples = LowercaseTask().sample(np.random.default_rng(0), 2)
    sampling = SamplingParams(n=4, max_tokens=40)
    proc, client = start_server("--model", model_dir, "--tokenizer", "bytes")
    try:
        remote = rollout.RemoteRollout(client.url, ADMIN)
        ours, theirs = (run.run(r, examples, [5, 6], sampling) for r in (local, remote))
        ours, theirs = list(ours), list(theirs)
        assert remote.prefix_cache()["hit_tokens"] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    assert local.prefix_cache()["hit_tokens"] > 0
    assert sum(len(e.turns) for g in ours for e in g) > 8  # several turns
    for a, b in zip((e for g in ours for e in g), (e for g in theirs for e in g), strict=True):
        assert a.tokens == b.tokens and a.ended_by == b.ended_by and a.reward == b.reward
        assert_bits_equal(a.logprobs, b.logprobs, "local vs remote episode logprobs")


def test_a_worked_episode_has_the_tokens_the_rollout_assembles(qwen, tmp_path):
    """train.sft --env trains on the sequence train.grpo --env would sample for the same turns: the calculator
    word problems' worked `turns` give the EpisodeRunner's tokens and mask, and the SFT batch trains exactly the
    assistant turns' tokens (eos included)."""
    from rlkjax.rl.environments import worked_episode
    from train import sft
    from train.word_problems import write

    tokenizer, template, _ = qwen
    train, _ = write(tmp_path, train=2, eval=1, kind="calculator")
    row = json.loads(train.read_text().splitlines()[0])
    task = make_task("math", str(train))
    run = runner((tokenizer, template, task))
    episode = run.start(task.examples[0])
    for message in row["turns"][::2]:
        run.advance(episode, sampled(tokenizer, message["content"]))
    assert episode.done and episode.reward == 1.0 and len(episode.turns) == 2
    tokens, mask = worked_episode(template, tokenizer, row["turns"], IM_END, enable_thinking=True)
    assert tokens == episode.completion and mask == episode.mask.tolist()
    batch = sft.make_batch([(episode.prompt, tokens, mask)])
    cols = np.flatnonzero(batch.mask[0])
    assert batch.tokens[0, cols + 1].tolist() == [t for turn in episode.turns for t in turn.sampled]
    with pytest.raises(ValueError, match="start and end with an assistant"):
        worked_episode(template, tokenizer, row["turns"][:2], IM_END)


@pytest.mark.slow  # a warm-up and a GRPO step of the real-vocabulary model at the calculator's prompt length
def test_calculator_warm_up_then_grpo_episodes_call_the_tool(tmp_path):
    """docs/demo.md's calculator path in miniature: train.sft --env calculator on one worked episode, then a
    train.grpo --env calculator step. The episodes call the calculator and read its <tool_response>, the
    environment's tokens are never trained (the row's sampled tokens are exactly those compared), and every
    sampled token of every turn has the learner's bits."""
    from train import sft
    from train.word_problems import write

    model = write_tiny_qwen3(tmp_path / "tiny")
    train, _ = write(tmp_path / "data", train=1, eval=1, kind="calculator")
    common = dict(data=str(train), env="calculator", enable_thinking=False)
    sft.train(
        sft.SFTConfig(
            model=str(model),
            out=str(tmp_path / "sft"),
            steps=40,
            batch_size=2,
            log_every=40,
            optimiser=Optimiser(learning_rate=1e-2, warmup_steps=2),
            **common,
        )
    )
    config = GRPOConfig(
        source=ModelSource(str(tmp_path / "sft")),
        task="math",
        max_turns=3,
        prompts_per_step=1,
        group_size=2,
        temperature=0.5,
        max_prompt_tokens=240,
        max_new_tokens=80,
        steps=1,
        checkpoint_every=0,
        progress=False,
        out=str(tmp_path / "grpo"),
        **common,
    )
    (row,) = grpo.train(config)["history"]
    assert row["tool_results_mean"] > 0 and row["turns_mean"] > 1 and row["env_tokens_mean"] > 0, row
    assert row["tokens_bits_differ"] == 0 and row["first_update_tokens_compared"] == row["tokens_compared"]
    assert row["tokens_compared"] == 2 * row["sampled_tokens_mean"]
