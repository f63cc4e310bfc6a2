"""A checkpoint's tokenizer files built for the tests (a byte-level BPE like Qwen's, with an eos
token and a chat template), shared by the text and OpenAI route tests."""

import json

TEXT = "héllo wörld, 1 € und 🙂 zwei\n\nnächste Zeile"


def make_bpe_checkpoint(directory):
    """A byte-level BPE (Qwen's tokenizer family) trained here on a few lines, saved with a tokenizer_config.json
    that names its eos token and a chat template (a checkpoint's tokenizer files, as the server reads them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT, "hello world", "und zwei und drei"] * 5, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | tojson }}\n{% endfor %}"
                "{% if add_generation_prompt %}{{ eos_token }}{% endif %}",
            }
        )
    )
    return directory


def make_qwen3_template_checkpoint(directory, samples: list[str], added_texts: list[str] = ()):
    """Qwen3's real chat template and added tokens (<|im_start|>, <|im_end|>, <tool_call>, <tool_response>, ...)
    over a byte-level BPE of at most 512 ids (the tiny preset's vocabulary), trained on `samples` (e.g. the
    rendered prompts a test sends, so they fit the tiny engine's context): what a server on qwen3-tiny needs to
    render tools and tool turns exactly as a Qwen3 checkpoint does. The real tokenizer has 151,669 ids.
    added_texts: more strings that become tokens of their own (tests/tool_caller.py's reply pieces)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from rlkjax.text.qwen_tokenizer import QWEN3_ADDED_TOKENS, QWEN3_CHAT_TEMPLATE

    keep = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>")
    keep += ("</tool_response>", "<think>", "</think>")
    added = [(content, special) for _, content, special in QWEN3_ADDED_TOKENS if content in keep]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    added += [(text, False) for text in added_texts]
    trainer = trainers.BpeTrainer(vocab_size=500 - len(added), show_progress=False)
    tok.train_from_iterator(samples * 3, trainer)
    for content, special in added:
        token = AddedToken(content, normalized=False, special=special)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    tok.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN3_CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
