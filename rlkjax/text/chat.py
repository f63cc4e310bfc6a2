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

from rlkjax.core.config import read_json

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
    def __init__(self, source: str, special_tokens: dict, origin: str = "the chat template"):
        """origin names the template in the ValueError a syntax error raises (its file, or tokenizer_config.json)."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source, self.special_tokens = source, special_tokens
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"{origin}: not a valid Jinja template (line {e.lineno}: {e.message})") from None

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
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
            # Python's own errors on what the client sent (`{% for t in tools %}` over a number, a
            # string plus a list): the template is fixed, so the input is what is wrong
            raise ChatTemplateError(f"the chat template cannot render the request: {type(e).__name__}: {e}") from None


def _tokenizer_config(tokenizer) -> dict:
    directory = getattr(tokenizer, "directory", None)
    path = Path(directory) / "tokenizer_config.json" if directory is not None else None
    return read_json(path) if path is not None and path.exists() else {}


def _special_tokens(config: dict) -> dict:
    return {name: _token_text(config[name]) for name in SPECIAL_TOKENS if config.get(name) is not None}


def load_chat_template(tokenizer) -> ChatTemplate:
    """The template of the tokenizer's checkpoint (`tokenizer.directory`), DEFAULT_TEMPLATE for the byte
    tokenizer, or None for a checkpoint without one: its chat route then answers 400 rather than make up a
    format the model was not trained on (/v1/completions still works)."""
    directory = getattr(tokenizer, "directory", None)
    if directory is None:
        return ChatTemplate(DEFAULT_TEMPLATE, {})
    config = _tokenizer_config(tokenizer)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: HF uses "default"
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    jinja_file = Path(directory) / "chat_template.jinja"
    if source is None and jinja_file.exists():
        source = jinja_file.read_text()
    origin = f"{Path(directory) / 'tokenizer_config.json'}'s chat_template"
    if source is not None and "chat_template" not in config:
        origin = str(jinja_file)
    return None if source is None else ChatTemplate(source, _special_tokens(config), origin)


class PromptFormat:
    """A task's prompt text -> the text sampled after: a user message (after `system_prompt`, if any)
    rendered with `template` and the assistant's generation prompt, as /v1/chat/completions renders it;
    the text unchanged when `template` is None. `enable_thinking` is Qwen3's switch (its template adds an
    empty <think></think> block when it is False; templates without the switch ignore it)."""

    def __init__(self, template: ChatTemplate | None, system_prompt: str | None = None, enable_thinking: bool = True):
        self.template, self.system_prompt, self.enable_thinking = template, system_prompt, enable_thinking

    def __call__(self, prompt: str) -> str:
        if self.template is None:
            return prompt
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        messages = [*system, {"role": "user", "content": prompt}]
        return self.template.render(messages, add_generation_prompt=True, enable_thinking=self.enable_thinking)


def prompt_format(choice: str, tokenizer, system_prompt: str | None = None, enable_thinking: bool = True):
    """choice: "auto" (the checkpoint's chat template; plain text for the byte tokenizer of the presets or a
    checkpoint without a template), "none" (plain text), or the path of a Jinja template file (rendered with
    the checkpoint's special tokens). A system prompt or thinking switch with no template is an error: it
    would be silently dropped."""
    if choice == "none":
        template = None
    elif choice == "auto":
        template = load_chat_template(tokenizer) if getattr(tokenizer, "directory", None) is not None else None
    else:
        path = Path(choice)
        if not path.is_file():
            raise ValueError(f"chat template {choice!r}: not 'auto', 'none' or a template file")
        template = ChatTemplate(
            path.read_text(), _special_tokens(_tokenizer_config(tokenizer)), f"chat template {choice}"
        )
    if template is None and system_prompt is not None:
        raise ValueError(f"a system prompt needs a chat template (chat template {choice!r} gives plain prompts)")
    if template is None and not enable_thinking:
        raise ValueError(f"the thinking switch needs a chat template (chat template {choice!r} gives plain prompts)")
    return PromptFormat(template, system_prompt, enable_thinking)


def message_text(content) -> str:
    """OpenAI message content: a string or a list of {"type": "text", "text": ...} parts (joined by
    newlines, as vLLM joins them); other part types are refused."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        if all(isinstance(p.get("text"), str) for p in content):
            return "\n".join(p["text"] for p in content)
    raise ValueError("message content must be a string or a list of {'type': 'text', 'text': str} parts")
