"""Tokenizers: HF `tokenizer.json` for real checkpoints, a byte tokenizer for the tiny model.

Both expose encode(text) -> list[int], decode(ids) -> str and eos_token_id.
"""

from pathlib import Path

from tokenizers import Tokenizer

from rlkjax.core.config import PRESETS, read_json


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 is end-of-sequence. Fits any vocab of at least 257."""

    eos_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's tokenizer.json, with the eos token named in tokenizer_config.json if present."""

    def __init__(self, directory):
        directory = Path(directory)
        self.directory = directory  # where the server finds tokenizer_config.json's chat template
        try:
            self.tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001  the tokenizers library raises a bare Exception on a malformed file
            raise ValueError(
                f"{directory / 'tokenizer.json'}: not a tokenizer the tokenizers library reads ({e})"
            ) from None
        config = directory / "tokenizer_config.json"
        eos = read_json(config).get("eos_token") if config.exists() else None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token_id = self.tok.token_to_id(eos) if eos else None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))


def load_tokenizer(model: str | Path | None, tokenizer: str | Path | None = None):
    """The tokenizer for `model` (a preset name or a checkpoint directory).

    tokenizer: "bytes", or a directory holding tokenizer.json; None picks the byte tokenizer for a
    preset and the checkpoint's own tokenizer.json otherwise. A checkpoint without one is an error,
    not a silent byte tokenizer that would turn its prompts into the wrong ids.
    """
    if tokenizer == "bytes" or (tokenizer is None and (model is None or str(model) in PRESETS)):
        return ByteTokenizer()
    directory = Path(tokenizer if tokenizer is not None else model)
    if directory.is_file() and directory.name == "tokenizer.json":
        directory = directory.parent
    if not (directory / "tokenizer.json").is_file():
        hint = (
            ""
            if tokenizer is not None
            else " (name one with --tokenizer DIR, or --tokenizer bytes for the byte tokenizer)"
        )
        raise ValueError(f"{directory} has no tokenizer.json{hint}")
    return HFTokenizer(directory)
