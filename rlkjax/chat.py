"""Chat messages -> prompt text, with the checkpoint's chat template rendered as Hugging Face renders it.

`transformers.apply_chat_template` compiles `tokenizer_config.json`'s "chat_template" (or the file
chat_template.jinja beside it) in jinja2's ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks
and the loopcontrols extension, adds the helpers `raise_exception`, `strftime_now` and a `tojson` filter
that keeps non-ASCII characters, and renders with messages, tools, add_generation_prompt and the special
tokens (bos_token, eos_token, ...). This module does the same, so a prompt here has the same text, and so
the same token ids (encoded without special tokens, as HF does), as HF's.

A checkpoint without a template (the byte-tokenizer presets) gets DEFAULT_TEMPLATE: ChatML, the format
of Qwen's own templates (`<|im_start|>role\\ncontent<|im_end|>\\n`, then `<|im_start|>assistant\\n`).
"""

import datetime
import json
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the messages (its raise_exception, or a rendering error): the client's 400."""


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def _token_text(value):
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source, self.special_tokens = source, special_tokens
        self.template = env.from_string(source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        try:
            return self.template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **(self.special_tokens | kwargs),
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from None


def load_chat_template(tokenizer) -> ChatTemplate:
    """The template of the tokenizer's checkpoint (`tokenizer.directory`), DEFAULT_TEMPLATE for the byte
    tokenizer, or None for a checkpoint without one: its chat route then answers 400 rather than make up a
    format the model was not trained on (/v1/completions still works)."""
    directory = getattr(tokenizer, "directory", None)
    if directory is None:
        return ChatTemplate(DEFAULT_TEMPLATE, {})
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: HF uses "default"
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    jinja_file = Path(directory) / "chat_template.jinja"
    if source is None and jinja_file.exists():
        source = jinja_file.read_text()
    special = {name: _token_text(config[name]) for name in SPECIAL_TOKENS if config.get(name) is not None}
    return None if source is None else ChatTemplate(source, special)


def message_text(content) -> str:
    """OpenAI message content: a string or a list of {"type": "text", "text": ...} parts (joined by
    newlines, as vLLM joins them); other part types are refused."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        if all(isinstance(p.get("text"), str) for p in content):
            return "\n".join(p["text"] for p in content)
    raise ValueError("message content must be a string or a list of {'type': 'text', 'text': str} parts")
