"""Nothing silently wrong on the learner side (issue 13): flags checked as they are used, data files
checked line by line when loaded, non-finite values stop train.grpo before anything is written from
them, and checkpoints that prove themselves (real orbax files with real flipped or truncated bytes)
resume bit-identically or not at all."""
import json

import pytest
import tyro

from rlkjax.requests import MIN_TEMPERATURE
from rlkjax.tasks import GSM8KTask
from train import grpo

SMALL = dict(prompts_per_step=2, group_size=4, max_new_tokens=4, max_prompt_tokens=16, progress=False)


# ----- 1. flags -----
@pytest.mark.parametrize("name,value", [
    ("weight_decay", float("nan")), ("weight_decay", float("inf")), ("max_grad_norm", float("nan")),
    ("max_grad_norm", float("inf")), ("beta", float("nan")), ("beta", float("inf")), ("tis_cap", float("nan")),
    ("clip_eps", float("nan")), ("learning_rate", 1e39),  # finite as a float64, inf as the float32 it is used as
    ("warmup_steps", -1), ("temperature", 1e-46), ("temperature", float("nan")), ("seed", -1), ("seed", 2**32),
])
def test_flags_are_checked_as_they_are_used(name, value):
    """NaN passes every comparison (`nan < 0` is False), so `--beta nan` trained today; 1e-46 passes a
    float64 `> 0` check and becomes 0 in float32 (NaN logprobs). Each error names the flag and the value."""
    with pytest.raises(ValueError) as error:
        grpo.GRPOConfig(**{name: value})
    message = str(error.value)
    assert f"--{name.replace('_', '-')}" in message and repr(value) in message, message


def test_help_names_the_smallest_temperature(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        tyro.cli(grpo.GRPOConfig, args=["--help"])
    assert f"at least {MIN_TEMPERATURE}" in capsys.readouterr().out


# ----- 8. data files -----
def gsm8k(question="1+1?", answer="so #### 2"):
    return json.dumps({"question": question, "answer": answer})


@pytest.mark.parametrize("lines,error", [
    (["", gsm8k(), "", "{not json"], ":4: not valid JSON"),  # blank lines counted: the bad line is line 4, not 2
    ([gsm8k(), gsm8k(question=5)], ":2: 'question' must be a string, got int"),
    ([gsm8k(answer=["#### 2"])], ":1: 'answer' must be a string, got list"),
    ([json.dumps({"question": "q"})], ":1: 'answer' must be a string, got nothing"),
    ([gsm8k(), gsm8k(answer="no final answer")], ":2: need a non-empty 'question' and an 'answer' ending in '#### <number>'"),
    ([gsm8k(), gsm8k(answer="#### ")], ":2: need"),
    (["[1, 2]"], ":1: expected a JSON object, got list"),
    (["", ""], ": no examples"),
])
def test_data_file_errors_name_the_file_and_line(tmp_path, lines, error):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as e:
        GSM8KTask(path)
    assert str(e.value).startswith(f"{path}{error}") and "\n" not in str(e.value), str(e.value)


def test_binary_and_unicode_data_files(tmp_path):
    """A binary file is one line naming the file (not a UnicodeDecodeError); U+2028 inside a JSON string
    is valid JSONL and must not split the line (str.splitlines would) or shift later line numbers."""
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"{}\n\x89PNG\r\n\x1a\n\x00\xff")
    with pytest.raises(ValueError, match=r"model.safetensors:2: not UTF-8 text \(byte 0x89 at offset 3\)"):
        GSM8KTask(binary)
    text = tmp_path / "unicode.jsonl"
    text.write_text(json.dumps({"question": "a\u2028b\x85c", "answer": "#### -3"}, ensure_ascii=False) + "\n" + "oops\n")
    with pytest.raises(ValueError, match="unicode.jsonl:2: not valid JSON"):
        GSM8KTask(text)
    text.write_text("\ufeff" + json.dumps({"question": "a\u2028b", "answer": "#### -3"}, ensure_ascii=False) + "\n")
    assert GSM8KTask(text).examples[0].prompt == "a\u2028b" and GSM8KTask(text).examples[0].answer == "-3"
