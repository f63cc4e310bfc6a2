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
