"""Errors a user can act on: a malformed model, tokenizer or template file is a ValueError naming the file."""

import json
import shutil
from pathlib import Path

import pytest

from rlkjax.core.checkpoint import load_hf_checkpoint
from rlkjax.core.config import ModelConfig
from rlkjax.text.chat import prompt_format
from rlkjax.text.tokenizer import ByteTokenizer, load_tokenizer
from tests.test_episodes import COMPACT

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "fixtures" / "hf_qwen3_tied"  # config.json + model.safetensors, no tokenizer


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    """Malformed inputs: a config.json that is not JSON, one without vocab_size, a safetensors file that is not
    one, a checkpoint with a broken tokenizer.json, a template that does not parse, a data file and its row."""
    root = tmp_path_factory.mktemp("bad")
    for name in ("not_json", "no_vocab", "bad_weights", "bad_tokenizer"):
        (root / name).mkdir()
    (root / "not_json" / "config.json").write_text("{model_type: qwen3")
    (root / "no_vocab" / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64}))
    shutil.copy(TINY / "config.json", root / "bad_weights")
    (root / "bad_weights" / "model.safetensors").write_bytes(b"not safetensors")
    for f in ("config.json", "model.safetensors"):
        shutil.copy(TINY / f, root / "bad_tokenizer")
    (root / "bad_tokenizer" / "tokenizer.json").write_text('{"model": ')
    (root / "template.jinja").write_text("{% for m in messages %}{{ m.content }")
    (root / "problems.jsonl").write_text(json.dumps({"question": "What is 1+1?", "answer": "so #### 2"}) + "\n")
    (root / "compact.jinja").write_text(COMPACT)
    return root


def test_loaders_name_the_malformed_file(bad_files):
    """rlkjax's loaders: a malformed file is a ValueError naming it (a JSONDecodeError, KeyError, SafetensorError
    or the tokenizers library's bare Exception used to escape without the file's name)."""
    cases = [
        (lambda: ModelConfig.from_hf_config(bad_files / "not_json" / "config.json"), "not_json/config.json: not valid"),
        (lambda: ModelConfig.from_hf_config(bad_files / "no_vocab" / "config.json"), "no integer 'vocab_size'"),
        (lambda: load_hf_checkpoint(bad_files / "bad_weights"), "model.safetensors: not a readable safetensors"),
        (lambda: load_tokenizer(bad_files / "bad_tokenizer"), "tokenizer.json: not a tokenizer"),
        (lambda: prompt_format(str(bad_files / "template.jinja"), ByteTokenizer()), "not a valid Jinja template"),
    ]
    for load, match in cases:
        with pytest.raises(ValueError, match=match):
            load()
