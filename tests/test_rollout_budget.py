"""train.grpo's rollout under a KV page budget: a step's P x G sequences are admitted as pages free up, and one that
must give its pages back is prefilled again later with the same tokens and logprob bits as in a run with pages for
everything (in-process engines and a `serve.rollout` server, single-turn groups and multi-turn episodes); the
memory plan sizes the budget; the metrics rows report the concurrency, the preemptions and the decode rate.

Every in-process rollout here has one of two engines, so each compiles once: rows 8 (P2 x G4) of up to 64 tokens
(prompts up to 24, 40 new), with a budget of 7 pages (6 usable: one sequence at full length takes 4, so the
sequences grow into each other and are preempted) or with pages for all 8 at full length (33)."""

import argparse
import dataclasses
import math

import numpy as np
import pytest

import rlkjax
from bench.memory_plan import chosen_by_run
from rlkjax.core.sampling_params import SamplingParams
from rlkjax.engine.config import EngineConfig
from rlkjax.entry_config import ModelSource
from rlkjax.rl.tasks import LowercaseTask
from rlkjax.text.chat import ChatTemplate, PromptFormat
from rlkjax.text.tokenizer import ByteTokenizer
from tests.helpers import EOS, assert_bits_equal, eos_model
from tests.server_process import ADMIN, engine_flags, start_server
from tests.test_episodes import COMPACT, AskAgain
from train import fsdp, grpo, memory
from train.config import GRPOConfig
from train.episodes import EpisodeRunner
from train.memory import GIB, RunShape
from train.rollout import LocalRollout, RemoteRollout, measure

ROWS, GROUP, PROMPT_TOKENS, NEW_TOKENS = 8, 4, 24, 40
MAX_LENGTH = PROMPT_TOKENS + NEW_TOKENS
TIGHT_PAGES = 7
TINY = rlkjax.ModelConfig.preset("qwen3-tiny")
# Prompts of 2 and 21 bytes. The model draws the eos about once in 10 tokens (tests.helpers.eos_model): the
# single-turn samples go past it, to full length, so they must grow into each other; the episodes' turns end at it.
PROMPTS, SEEDS = [list(b"ab"), list(b"the quick brown fox, ")], [11, 12]
SAMPLING = SamplingParams(n=GROUP, max_tokens=NEW_TOKENS, ignore_eos=True)
TURN = SamplingParams(n=GROUP, max_tokens=NEW_TOKENS)


def episodes_runner() -> EpisodeRunner:
    template = PromptFormat(ChatTemplate(COMPACT, {}))
    return EpisodeRunner(None, AskAgain(None), ByteTokenizer(), template, EOS, 3, NEW_TOKENS, PROMPT_TOKENS)


def local_rollout(model, kv_pages):
    cfg, params = model
    devices = fsdp.pick_devices("learner_devices", "0")
    mesh = fsdp.make_mesh(devices)
    return LocalRollout(
        params,
        cfg,
        "strict",
        mesh,
        devices,
        rows=ROWS,
        max_length=MAX_LENGTH,
        group=GROUP,
        kv_pages=kv_pages,
        eos_token_id=EOS,
    )


def sample_both(rollout) -> tuple:
    """(single-turn groups, their measure fields, multi-turn episodes, their measure fields) of one rollout."""
    with measure(rollout) as single:
        groups = rollout.sample(PROMPTS, SEEDS, SAMPLING)
    examples = LowercaseTask().sample(np.random.default_rng(0), 2)
    with measure(rollout) as multi:
        episodes = episodes_runner().run(rollout, examples, [5, 6], TURN)
    rollout.release_cache()
    return groups, single, episodes, multi


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return eos_model(tmp_path_factory.mktemp("eos_model"))


@pytest.fixture(scope="module")
def model(model_dir):
    return rlkjax.load_hf_checkpoint(model_dir)


@pytest.fixture(scope="module")
def ample(model):
    """The reference: pages for every sequence at full length, so nothing is preempted."""
    return sample_both(local_rollout(model, None))


def assert_same_samples(a, b, what):
    for ga, gb in zip(a, b, strict=True):
        for sa, sb in zip(ga, gb, strict=True):
            assert sa.tokens == sb.tokens and sa.policy_version == sb.policy_version, what
            assert_bits_equal(sa.logprobs, sb.logprobs, what)


def assert_same_episodes(a, b, what):
    for ea, eb in zip((e for g in a for e in g), (e for g in b for e in g), strict=True):
        assert ea.tokens == eb.tokens and ea.ended_by == eb.ended_by and ea.reward == eb.reward, what
        assert_bits_equal(ea.logprobs, eb.logprobs, what)


def test_engine_slots_follow_the_page_budget():
    """With pages for every row at full length the engine is the one train.grpo built before budgets
    (EngineConfig.for_batch, for 8 rows); a tight budget gets twice the sequences that fit at full length (not
    rounded up to a power of two), at least a group."""
    need = 1 + ROWS * math.ceil(MAX_LENGTH / 16)
    assert EngineConfig.for_budget(need, ROWS, MAX_LENGTH, GROUP) == EngineConfig.for_batch([MAX_LENGTH] * ROWS)
    assert EngineConfig.for_budget(need, 6, MAX_LENGTH, 3).max_batch == 6  # for_batch: 8
    assert EngineConfig.for_budget(1 + 3 * 4, 64, MAX_LENGTH, 4).max_batch == 6  # 3 fit at full length
    assert EngineConfig.for_budget(TIGHT_PAGES, ROWS, MAX_LENGTH, GROUP).max_batch == GROUP  # 1 fits: 2 < G
    with pytest.raises(ValueError, match="holds no sequence of 64 tokens"):
        EngineConfig.for_budget(4, ROWS, MAX_LENGTH, GROUP)


def test_tight_local_rollout_gives_the_ample_bits(model, ample):
    """Single-turn groups (the n = G samples forking from their prompt's pages) and 3-turn episodes (each later
    turn a request that extends the previous one through the prefix cache) under 7 KV pages: sequences are
    preempted and prefilled again, and every token and logprob bit is the one sampled with pages for all."""
    groups, single, episodes, multi = sample_both(local_rollout(model, TIGHT_PAGES))
    ample_groups, ample_single, ample_episodes, ample_multi = ample
    assert_same_samples(groups, ample_groups, "tight vs ample single-turn")
    assert_same_episodes(episodes, ample_episodes, "tight vs ample episodes")
    assert sum(len(e.turns) for g in episodes for e in g) > 8  # later turns ran
    for tight, roomy in ((single, ample_single), (multi, ample_multi)):
        assert tight["rollout_preemptions"] > 0 and tight["rollout_preempted_tokens"] > 0, tight
        assert roomy["rollout_preemptions"] == 0 and roomy["rollout_preempted_tokens"] == 0, roomy
        assert 1 <= tight["rollout_sequences_mean"] <= tight["rollout_sequences_peak"] <= GROUP, tight
        assert tight["rollout_decode_tokens_per_s"] > 0 and roomy["rollout_decode_tokens_per_s"] > 0
    # with pages for all, the 8 single-turn samples decode together
    assert ample_single["rollout_sequences_peak"] == ROWS > single["rollout_sequences_peak"]


@pytest.mark.slow  # starts a server (its programs compile in its own process)
def test_tight_server_gives_the_ample_bits(model_dir, ample):
    """RemoteRollout against a `serve.rollout` server on loopback whose engine has the tight budget's pages and
    slots: the same single-turn groups and episodes, bit for bit, as the in-process engine with pages for all, and
    the server's preemptions in the measure fields."""
    sizing = EngineConfig.for_budget(TIGHT_PAGES, ROWS, MAX_LENGTH, GROUP)  # the tight LocalRollout's
    proc, client = start_server("--model", model_dir, "--tokenizer", "bytes", *engine_flags(sizing))
    try:
        groups, single, episodes, multi = sample_both(RemoteRollout(client.url, ADMIN))
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    assert_same_samples(groups, ample[0], "server (tight) vs in-process (ample) single-turn")
    assert_same_episodes(episodes, ample[2], "server (tight) vs in-process (ample) episodes")
    for fields in (single, multi):
        assert fields["rollout_preemptions"] > 0 and "rollout_sequences_peak" not in fields, fields
        assert 1 <= fields["rollout_sequences_mean"] <= GROUP and fields["rollout_decode_tokens_per_s"] > 0


def test_grpo_under_a_tight_budget_preempts_with_zero_mismatch(model_dir, tmp_path, capfd):
    """train.grpo with --rollout-kv-gib worth 7 pages: every step's row shows preemptions, and every sampled
    token's logprob equals the learner's in its bits (the verify pass and the first update's ratio). The KV cache
    is released for the learner and allocated again for the second step's rollout. bench.memory_plan --train-log
    reads the settings back from the log's "memory plan:" line."""
    gib = TIGHT_PAGES * memory.kv_page_bytes(TINY) / GIB
    config = GRPOConfig(
        source=ModelSource(model_dir, tokenizer="bytes"),
        steps=2,
        prompts_per_step=2,
        group_size=GROUP,
        max_new_tokens=NEW_TOKENS,
        max_prompt_tokens=PROMPT_TOKENS,
        ignore_eos=True,  # every sequence grows to full length: 8 x 4 pages wanted, 6 there
        rollout_kv_gib=gib,
        verify_every=1,
        checkpoint_every=0,
        progress=False,
        out=str(tmp_path),
    )
    rows = grpo.train(config)["history"]
    for row in rows:
        assert row["rollout_kv_pages"] == TIGHT_PAGES and row["rollout_batch_slots"] == GROUP, row
        assert row["rollout_preemptions"] > 0 and row["rollout_sequences_peak"] <= GROUP, row
        assert row["tokens_bits_differ"] == 0 and row["tokens_compared"] == row["first_update_tokens_compared"] > 0
    args = argparse.Namespace(model="qwen3-tiny", lora_rank=0, moments="auto", remat="auto", micro_batch_tokens="auto")
    chosen_by_run(args, capfd.readouterr().err)
    assert (args.moments, args.remat, args.micro_batch_tokens) == ("device", "off", "512"), args
    assert args.kv_gib == gib, (args.kv_gib, gib)


def test_the_plan_sizes_the_kv_cache_by_the_budget():
    """Qwen3-8B, P16 x G8, 512 + 8192 tokens on one H200 with the moments on the host: every sequence at full
    length would take 128 x 544 pages of 2.25 MiB (36 layers x 8 KV heads x 16 positions x 128 x 2 B, K and V),
    153 GiB, the rollout 198.8 GiB with the weights; the budget is what the rollout leaves, less the reserve."""
    cfg = rlkjax.ModelConfig.preset("qwen3-8b")
    limit = 0.95 * 143771 * 2**20
    shape = RunShape(16, 8, 8192, 512, 16, remat="on", moments="host")
    page = memory.kv_page_bytes(cfg)
    assert page == 36 * 8 * 16 * 128 * 2 * 2
    assert memory.kv_pages_needed(shape) == 1 + 128 * 544 and memory.least_kv_pages(shape) == 545
    full = memory.peaks(memory.phases(cfg, shape))["rollout"]
    assert round(full / GIB, 1) == 198.8 and memory.kv_cache(cfg, shape) == (1 + 128 * 544) * page
    pages = memory.kv_budget(cfg, shape, limit)
    weights = 6 * memory.parameter_count(cfg)  # fp32 master + bf16 sampler
    assert pages == int((limit * (1 - memory.ROLLOUT_RESERVE) - weights) // page)
    budgeted = memory.phases(cfg, dataclasses.replace(shape, kv_pages=pages))["rollout"]
    assert budgeted["KV cache"] == pages * page and limit * 0.96 < sum(budgeted.values()) <= limit * 0.97
    assert (pages - 1) // 544 == 69  # sequences of full length it holds at once, of the step's 128
    # Capped at the step's need; unbounded (no limit known, as on a CPU): every sequence at full length.
    short = dataclasses.replace(shape, new_tokens=256, prompt_tokens=128)
    assert memory.kv_budget(cfg, short, limit) == memory.kv_pages_needed(short) == 1 + 128 * 24
    assert memory.kv_budget(cfg, shape, None) is None
    # --rollout-kv-gib: its pages, if they hold one sequence at full length.
    assert memory.kv_budget(cfg, shape, limit, 20.0) == 20 * GIB // page
    with pytest.raises(ValueError, match=r"--rollout-kv-gib=0.05 holds 22 KV pages; .* needs 545 .* at least 1.2 GiB"):
        memory.kv_budget(cfg, shape, limit, 0.05)
    with pytest.raises(ValueError, match="after 45.8 GiB of weights and state; a sequence of 8704 tokens needs 1.20"):
        memory.kv_budget(cfg, shape, 47 * GIB)


@pytest.mark.parametrize(
    "flags, match",
    [
        (dict(rollout_kv_gib=0.0), "--rollout-kv-gib=0.0 must be finite"),
        (dict(rollout_kv_gib=float("nan")), "--rollout-kv-gib=nan must be finite"),
        (dict(rollout_kv_gib=1.0, rollout_url="http://127.0.0.1:1"), "a server sets its own: --num-pages"),
    ],
)
def test_bad_budget_flags_name_the_value(flags, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**flags)
