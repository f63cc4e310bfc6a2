"""Tokenizers: HF `tokenizer.json` for real checkpoints, a byte tokenizer for the tiny model.

Both expose encode(text) -> list[int], decode(ids) -> str, eos_token_id and apply_chat_template.
"""
import json
from pathlib import Path

from tokenizers import Tokenizer


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 is end-of-sequence. Fits any vocab of at least 257."""

    eos_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, user_message: str) -> list[int]:
        return self.encode(f"Q: {user_message}\nA: ")


class HFTokenizer:
    """A checkpoint's tokenizer.json (+ the Qwen chat format when tokenizer_config.json has one)."""

    def __init__(self, directory):
        directory = Path(directory)
        self.tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = directory / "tokenizer_config.json"
        eos = json.loads(config.read_text()).get("eos_token") if config.exists() else None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token_id = self.tok.token_to_id(eos) if eos else None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))

    def apply_chat_template(self, user_message: str) -> list[int]:
        # Qwen3's ChatML turn format (the Jinja template reduces to this for one user message).
        return self.encode(f"<|im_start|>user\n{user_message}<|im_end|>\n<|im_start|>assistant\n")


def load_tokenizer(model_dir=None):
    """The checkpoint's tokenizer.json if there is one, else the byte tokenizer."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return HFTokenizer(model_dir)
    return ByteTokenizer()
