"""Training prompts in the chat format: a task's prompt rendered with the checkpoint's chat template (the code
/v1/chat/completions renders with), the system prompt and Qwen3's thinking switch, lengths checked after
rendering; the real Qwen3 tokenizer and template of the tiny real-vocabulary checkpoint."""

import pytest

from rlkjax.rl.data import Example
from rlkjax.text.chat import load_chat_template, prompt_format
from rlkjax.text.tokenizer import ByteTokenizer, load_tokenizer
from rlkjax.tiny_qwen3 import write_tiny_qwen3
from train.episodes import EpisodeRunner

IM_START, IM_END = 151644, 151645


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3")))


def test_auto_renders_as_the_chat_route(tokenizer):
    render = prompt_format("auto", tokenizer, system_prompt="Be brief.")
    server = load_chat_template(tokenizer).render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], True, enable_thinking=True
    )
    assert render("2+2?") == server
    assert render("2+2?") == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(render("2+2?"))
    assert ids[0] == IM_START and ids.count(IM_END) == 2  # the special tokens are single ids
    assert tokenizer.eos_token_id == IM_END  # completions end where the assistant's turn does


def test_thinking_switch_and_plain_prompts(tokenizer, tmp_path):
    off = prompt_format("auto", tokenizer, enable_thinking=False)
    assert off("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert prompt_format("none", tokenizer)("hi") == "hi"
    assert prompt_format("auto", ByteTokenizer())("hi") == "hi"  # a preset: plain text, as before
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}{{ eos_token }}")
    assert prompt_format(str(template), tokenizer)("hi") == "[user] hi<|im_end|>"  # the checkpoint's special tokens


@pytest.mark.parametrize(
    "choice, kwargs, match",
    [
        ("no/such/file.jinja", {}, "not 'auto', 'none' or a template file"),
        ("none", {"system_prompt": "x"}, "system prompt needs a chat template"),
        ("none", {"enable_thinking": False}, "thinking switch needs a chat template"),
    ],
)
def test_bad_choices(tokenizer, choice, kwargs, match):
    with pytest.raises(ValueError, match=match):
        prompt_format(choice, tokenizer, **kwargs)


def test_lengths_are_checked_after_rendering(tokenizer):
    """A prompt must fit --max-prompt-tokens as sampled: after the chat template, which adds tokens (checked by the
    runner that samples it, for every example before step 1)."""
    example = Example("What is 2+2?", "4", "data.jsonl:1")

    def runner(render, max_prompt_tokens):
        return EpisodeRunner(None, None, tokenizer, render, tokenizer.eos_token_id, 1, 8, max_prompt_tokens)

    render = prompt_format("auto", tokenizer)
    plain = len(tokenizer.encode("What is 2+2?"))
    assert runner(prompt_format("none", tokenizer), plain).start(example).prompt == tokenizer.encode("What is 2+2?")
    rendered = len(tokenizer.encode(render("What is 2+2?")))
    assert rendered == plain + 8  # <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n
    with pytest.raises(ValueError, match=f"data.jsonl:1: the first prompt is {rendered} tokens"):
        runner(render, plain).start(example)
    assert runner(render, rendered).start(example).prompt == tokenizer.encode(render("What is 2+2?"))
