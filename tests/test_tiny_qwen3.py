"""The tiny real-vocabulary Qwen3 checkpoint: it loads like a real one (151,936 rows, Qwen3's tokenizer,
eos <|im_end|>), its chat template renders conversations to the ids Qwen3 is trained on, and it
generates with sampler and learner log-probabilities equal bit for bit over the full vocabulary."""

import numpy as np
import pytest

import rlkjax
from rlkjax.text.chat import load_chat_template
from rlkjax.text.tokenizer import HFTokenizer, load_tokenizer
from rlkjax.tiny_qwen3 import QWEN3_VOCAB_SIZE, write_tiny_qwen3
from tests.helpers import assert_bits_equal

IM_START, IM_END, NEWLINE, USER, ASSISTANT, SYSTEM = 151644, 151645, 198, 872, 77091, 8948


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"), seed=0)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_tokenizer(str(checkpoint))


def test_loads_like_a_real_qwen3(checkpoint, tokenizer):
    cfg, params = rlkjax.load_hf_checkpoint(checkpoint)
    assert cfg.vocab_size == QWEN3_VOCAB_SIZE and params["embed_tokens"].shape == (QWEN3_VOCAB_SIZE, 64)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.eos_token_id == IM_END


def test_chat_template_renders_qwen3_ids(tokenizer):
    """The ids Qwen3 sees for one user turn: `<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n`,
    with "user", "assistant" and "\\n" as the single BPE tokens 872, 77091 and 198 (as in Qwen's vocab)."""
    template = load_chat_template(tokenizer)
    text = template.render([{"role": "user", "content": "What is 2+3?"}])
    assert text == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    question = tokenizer.encode("What is 2+3?")
    assert question == [3838, 374, 220, 17, 10, 18, 30]
    assert tokenizer.encode(text) == [IM_START, USER, NEWLINE, *question, IM_END, NEWLINE, IM_START, ASSISTANT, NEWLINE]
    system = template.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert tokenizer.encode(system)[:3] == [IM_START, SYSTEM, NEWLINE]
    assert system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_thinking_switch_and_history(tokenizer):
    """Qwen3's hybrid thinking: enable_thinking=False closes an empty think block in the generation
    prompt; an earlier assistant turn's reasoning is dropped from the history."""
    template = load_chat_template(tokenizer)
    user = [{"role": "user", "content": "Hi"}]
    off = template.render(user, enable_thinking=False)
    assert off == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tokenizer.encode(off)[-6:] == [ASSISTANT, NEWLINE, 151667, 271, 151668, 271]  # 271 is "\n\n"
    assert template.render(user, enable_thinking=True) == template.render(user)
    history = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nr1\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
    ]
    assert template.render(history) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n"
    )
    last = template.render(history[:2], add_generation_prompt=False)
    assert last.endswith("<|im_start|>assistant\n<think>\nr1\n</think>\n\nA1<|im_end|>\n")


def test_chat_template_tool_calls(tokenizer):
    """Qwen3's tool format: the tool list in the system turn, a call as <tool_call> JSON, the result as
    a user turn in <tool_response>; the four markers are single added tokens."""
    template = load_chat_template(tokenizer)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "4"},
    ]
    text = template.render(messages, tools=tools)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert (
        '<tools>\n{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}\n</tools>' in text
    )
    assert text.endswith(
        "<|im_start|>user\n2+2?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text)
    # <tool_call> and </tool_call>: twice in the system turn's instructions, once in the call
    assert [ids.count(marker) for marker in (151657, 151658, 151665, 151666)] == [3, 3, 1, 1]


@pytest.mark.slow
def test_generates_with_bitwise_equal_scores(checkpoint, tokenizer):
    """Sampling over all 151,936 logits of a chat-formatted prompt, then scoring the completion: the
    sampler's and the learner's log-probabilities have the same bits (a vocabulary tile past 151,669
    real tokens, or a padded row that leaked into the log-sum-exp, would break this)."""
    cfg, params = rlkjax.load_hf_checkpoint(checkpoint)
    prompt = tokenizer.encode(load_chat_template(tokenizer).render([{"role": "user", "content": "What is 2+3?"}]))
    comps = rlkjax.generate(params, cfg, [prompt, prompt[:5]], 3, 1.0, [0, 1], eos_token_id=tokenizer.eos_token_id)
    for c in comps:
        assert 1 <= len(c.tokens) <= 3 and all(0 <= t < QWEN3_VOCAB_SIZE for t in c.tokens)
        assert IM_END not in c.tokens[:-1]  # a sampled eos ends the completion
        assert np.all(np.isfinite(c.logprobs)) and np.all(c.logprobs < 0)
    scores = rlkjax.score(params, cfg, [prompt + comps[0].tokens, prompt[:5] + comps[1].tokens], [len(prompt), 5])
    for c, lp in zip(comps, scores):
        assert_bits_equal(lp, c.logprobs, "sampler vs learner logprobs")
