"""The OpenAI routes' text handling without a server: per-token strings that join into the text (byte
tokenizer and a byte-level BPE like Qwen's), stop strings found across token boundaries and cut out,
streaming that never lets a partial stop string out, and chat templates rendered as Hugging Face does."""

import pytest

from rlkjax.text.chat import DEFAULT_TEMPLATE, ChatTemplate, ChatTemplateError, load_chat_template, message_text
from rlkjax.text.tokenizer import ByteTokenizer, load_tokenizer
from serve.text import SampleText, offsets, token_pieces
from tests.tokenizer_files import TEXT, make_bpe_checkpoint


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return load_tokenizer(make_bpe_checkpoint(tmp_path_factory.mktemp("bpe")))


@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_token_pieces_join_into_the_text(which, bpe):
    """Each token's string is the text it adds: they join into decode(all tokens), a character split over
    tokens goes to the token that completes it, and text_offset is where each piece starts."""
    tok = ByteTokenizer() if which == "bytes" else bpe
    ids = tok.encode(TEXT)
    pieces = token_pieces(tok, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == tok.decode(ids) == TEXT
    assert offsets(pieces, 7) == [7 + len("".join(pieces[:i])) for i in range(len(pieces))]
    if which == "bytes":
        assert pieces[:3] == ["h", "", "é"]  # é is two bytes: the first token adds nothing yet
    # After a prompt: the pieces still join into the completion's text.
    prompt, rest = ids[:5], ids[5:]
    assert "".join(token_pieces(tok, rest, prompt)) == tok.decode(ids)[len(tok.decode(prompt)) :]


@pytest.mark.parametrize("include_stop", [False, True])
def test_a_stop_string_split_over_tokens_ends_the_text(include_stop):
    """ "\\n\\nn" spans three tokens and arrives in the middle of a round: add() keeps the tokens up to the one
    that completed it, cuts the text at it (or after it with include_stop), and the pieces still join."""
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    c = SampleText(tok, tok.encode("prompt"), ["zzz", "\n\nn"], include_stop)
    cut = TEXT.index("\n\nn")
    first = len(TEXT[:cut].encode()) - 1  # the first round ends one byte before the stop string
    assert c.add(ids[:first], [0.0] * first) is None
    keep = c.add(ids[first:], [0.0] * (len(ids) - first))
    assert keep == 4 and c.stopped  # the last byte before "\n\nn" and the three bytes of it
    assert c.text == TEXT[: cut + (3 if include_stop else 0)] == "".join(c.pieces)
    assert c.tokens == ids[: first + keep] and len(c.logprobs) == first + keep


def test_streaming_holds_back_what_may_become_a_stop_string():
    """A streamed piece is never cut later: the last len(longest stop) - 1 characters wait until the text
    moves past them or the sample ends, and a split character waits for its last byte."""
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    c = SampleText(tok, [1], ["wörld!", "xx"], False)
    sent, streamed = 0, ""
    for t in ids:
        c.add([t], [0.0])
        safe = c.safe_tokens(sent)
        streamed += "".join(c.pieces[sent:safe])
        sent = safe
        assert TEXT.startswith(streamed) and len(c.text) - len(streamed) <= len("wörld!") - 1 + 3
    c.finish()
    assert streamed + "".join(c.pieces[sent:]) == c.text == TEXT


def test_a_trailing_split_character_is_flushed_at_the_end():
    """A sample that ends inside a UTF-8 character: its bytes show as U+FFFD on the last token."""
    tok = ByteTokenizer()
    c = SampleText(tok, [1], [], False)
    c.add(list("a€".encode())[:-1], [0.0, 0.0, 0.0])
    assert c.text == "a" and c.safe_tokens(0) == 1
    c.finish()
    assert c.text == "a\ufffd" == "".join(c.pieces)


def test_chat_templates_render_as_hugging_face_does(bpe):
    """The checkpoint's template with HF's environment: trim_blocks/lstrip_blocks, tojson that keeps
    non-ASCII, special tokens by name, raise_exception as a 400-worthy error; the byte-tokenizer default is ChatML."""
    template = load_chat_template(bpe)
    messages = [{"role": "user", "content": "grüß dich"}]
    assert template.render(messages) == 'user: "grüß dich"\n<|im_end|>'
    assert template.render(messages, add_generation_prompt=False) == 'user: "grüß dich"\n'
    default = load_chat_template(ByteTokenizer())
    assert default.source == DEFAULT_TEMPLATE
    assert default.render(messages + [{"role": "assistant", "content": "hi"}]) == (
        "<|im_start|>user\ngrüß dich<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    strict = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{% endfor %}{{ strftime_now('%Y') | length }}",
        {},
    )
    assert strict.render(messages) == "4"
    with pytest.raises(ChatTemplateError, match="no system role"):
        strict.render([{"role": "system", "content": "x"}])
    sandboxed = ChatTemplate("{{ ''.__class__.__mro__ }}", {})
    with pytest.raises(ChatTemplateError):
        sandboxed.render(messages)
    assert message_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "a\nb"
    with pytest.raises(ValueError, match="content"):
        message_text([{"type": "image_url", "image_url": "x"}])
