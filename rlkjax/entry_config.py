"""The typed pieces the entry points' configs share (`python -m train.grpo`, `python -m train.sft`,
`python -m serve.rollout`): where the model comes from (`ModelSource`) and how the process runs it
(`Runtime`). Each is a frozen dataclass whose field docstrings are the `--help` text, checked when built; an
entry point nests it with its own default and tyro.conf.OmitArgPrefixes, so its flags keep their plain
names (--model, --numerics, ...). `flat` reads a config back as those flags.
"""

import dataclasses
from typing import Literal

from rlkjax.engine import compilation_cache


@dataclasses.dataclass(frozen=True)
class ModelSource:
    model: str = "qwen3-tiny"
    """A preset (random weights from --seed), an HF checkpoint dir, or an orbax dir (config.json + params/)."""
    tokenizer: str | None = None
    """'bytes' (the tiny model's byte tokenizer) or a directory with tokenizer.json. Default: the byte tokenizer
    for a preset, the checkpoint's own tokenizer.json otherwise (a checkpoint without one is an error)."""


@dataclasses.dataclass(frozen=True)
class Runtime:
    numerics: Literal["strict", "fast"] = "strict"
    """strict: our Pallas kernels, the sampler's and the learner's logprobs equal bit for bit. fast: plain XLA
    (cuBLAS dots, XLA softmax), for comparison or where the logprob contract is not needed."""
    compilation_cache: str = compilation_cache.default_dir()
    """JAX's persistent compilation cache: a directory (created if missing), or 'off'. A later process loads the
    programs an earlier one compiled (the same executables, so the same bits) instead of compiling them. Delete
    the directory to reclaim its space."""

    def __post_init__(self):
        compilation_cache.check(self.compilation_cache)


def flat(config) -> dict:
    """{flag name (underscores): value} of a config, each nested config's fields in its place (the flags tyro
    builds with OmitArgPrefixes): what a user typed, as one level."""
    out = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        out |= flat(value) if dataclasses.is_dataclass(value) else {field.name: value}
    return out


def flat_defaults(config_type) -> dict:
    """`flat` of a config type's defaults (a field without one is left out)."""
    out = {}
    for field in dataclasses.fields(config_type):
        if dataclasses.is_dataclass(field.default):
            out |= flat(field.default)
        elif field.default is not dataclasses.MISSING:
            out[field.name] = field.default
    return out
