"""The server's flags (`python -m serve.rollout --help`), each checked once when the config is built, and
the admin key they point to."""

import dataclasses
import math
import os
from pathlib import Path
from typing import Annotated

import tyro

from rlkjax.engine.config import EngineConfig
from rlkjax.entry_config import ModelSource, Runtime


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    source: Annotated[ModelSource, tyro.conf.OmitArgPrefixes] = ModelSource()
    """The weights served and their tokenizer."""
    host: str = "127.0.0.1"
    """Interface to bind. The default serves this machine only; 0.0.0.0 exposes it to the network."""
    port: int = 8000
    """TCP port."""
    admin_key: str | None = None
    """Key for POST /update_weights and /v1/load_lora_adapter. Prefer --admin-key-file or RLKJAX_ADMIN_KEY: a flag
    is visible in `ps`. With none of the three, weight and adapter updates are refused."""
    admin_key_file: str | None = None
    """File holding the admin key (its first line)."""
    lora_adapter: str | None = None
    """A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors, as train.grpo --lora-rank
    writes) served on --model, unmerged through the learner's kernels; POST /v1/load_lora_adapter then swaps in
    others of its rank, alpha and targets."""
    seed: int = 0
    """Seed of the random weights when --model is a preset."""
    runtime: Annotated[Runtime, tyro.conf.OmitArgPrefixes] = Runtime()
    """The numerics and the compilation cache."""
    engine: Annotated[EngineConfig, tyro.conf.OmitArgPrefixes] = EngineConfig(max_context=4096)
    """The rollout engine: KV cache, batch and prefill sizes."""
    max_prompts: int = 256
    """Most prompts in one request."""
    max_sequences: int = 256
    """Most sequences (prompts x n) in one request; requests also take turns in admission, so a big one cannot
    hold back a small one that came after it."""
    read_timeout: float = 30.0
    """Seconds a client has to send its whole request body (a slow client gets 408)."""
    max_body_bytes: int = 4 * 2**20
    """Larger request bodies get 413."""
    header_timeout: float = 15.0
    """Seconds a connection has to send a complete request head, from opening or from the end of its previous
    response; then it is closed (a client trickling its headers, an idle keep-alive connection)."""
    max_connections: int = 512
    """Most open connections; past it a new connection gets 503 and is closed. Each open connection needs a file
    descriptor: keep this under the process's limit (`ulimit -n`)."""
    warmup: bool = True
    """Compile every batch shape of default requests before accepting any (prefill and decode rounds of 1, 2, 4,
    ... --max-batch sequences, page copies for n > 1): a few seconds per shape (far less from a warm
    --compilation-cache), so no request waits behind a compilation mid-serving. The server listens meanwhile:
    /health answers 503 "starting" with the progress, generation routes 503 with Retry-After. Options such as
    top_logprobs, top_k/top_p/min_p or several stop ids still compile on first use. --no-warmup is ready at
    once."""
    shutdown_timeout: float = 300.0
    """On SIGTERM/SIGINT: /health turns 503 "draining" and new work gets 503; what is in flight finishes for up
    to this many seconds, then the rest is cancelled (its clients get 503, a stream its error event and [DONE])
    and the process exits 0. A second signal cancels at once and exits within a second."""

    def __post_init__(self):
        for name in ("port", "max_prompts", "max_sequences", "max_body_bytes", "max_connections"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be positive")
        if not (math.isfinite(self.shutdown_timeout) and self.shutdown_timeout >= 0):
            raise ValueError(f"--shutdown-timeout={self.shutdown_timeout} must be a finite number >= 0")
        for name in ("read_timeout", "header_timeout"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be a finite number > 0")


def admin_key(config: ServerConfig) -> str | None:
    """The key for POST /update_weights: --admin-key-file, else --admin-key, else RLKJAX_ADMIN_KEY; None: updates
    are refused."""
    if config.admin_key_file:
        try:
            lines = Path(config.admin_key_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ValueError(f"--admin-key-file {config.admin_key_file}: cannot read it ({why})") from None
        if not lines or not lines[0].strip():
            raise ValueError(f"--admin-key-file {config.admin_key_file} is empty")
        return lines[0].strip()
    return config.admin_key or os.environ.get("RLKJAX_ADMIN_KEY") or None
