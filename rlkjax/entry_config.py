"""The typed pieces the entry points' configs share (`python -m train.grpo`, `python -m train.sft`,
`python -m serve.rollout`): where the model comes from (`ModelSource`) and how the process runs it
(`Runtime`). Each is a frozen dataclass whose field docstrings are the `--help` text, checked when built; an
entry point nests it with its own default and tyro.conf.OmitArgPrefixes, so its flags keep their plain
names (--model, --numerics, ...). `flat` reads a config back as those flags.

And how the entry points stop on bad input (`Refusal`, `refusing`, `exit_plainly`): a run refused at start (a
flag, a combination of flags, a missing or malformed file, a run the memory plan says cannot fit) prints its
message and exits with status 2, no traceback, as the flag parser (tyro) does for a flag it cannot read or a
config's __post_init__ refuses. Only refusals: anything else raised keeps its traceback, since it is a bug to
look at, not input to fix.
"""

import contextlib
import dataclasses
import sys
import traceback
from typing import Literal

from rlkjax.engine import compilation_cache
from rlkjax.rl.environments import EnvironmentFailure


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

    def enable_compilation_cache(self) -> None:
        """compilation_cache.enable, before the first compilation; a directory that cannot be made is refused."""
        try:
            compilation_cache.enable(self.compilation_cache)
        except OSError as e:
            raise Refusal(
                f"--compilation-cache={self.compilation_cache!r}: cannot create the directory ({e.strerror or e}); "
                "name another, or 'off'"
            ) from e


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


# ----- how an entry point stops on bad input -----
class Refusal(ValueError):
    """A run refused before it starts, for input the user can fix; the message names the flag or the file and
    what to do. A ValueError, as the library's own checks raise, so a caller that catches those still does."""


@contextlib.contextmanager
def refusing():
    """Inside: a ValueError, rlkjax's error for bad input (a loader's missing or malformed file, a check of a flag
    against the model or the data), is raised again as a Refusal. For the start of an entry point, around the
    calls that read what the user named, not around the steps that compute."""
    try:
        yield
    except Refusal:
        raise
    except ValueError as e:
        raise Refusal(str(e)) from e


@contextlib.contextmanager
def exit_plainly(prog: str):
    """An entry point's main runs inside: a Refusal prints `prog: message` to stderr and exits with status 2; an
    environment that raised (EnvironmentFailure) prints its headline, then the environment's own traceback (what
    a user debugging it needs), and exits with status 1. Anything else propagates with its traceback."""
    try:
        yield
    except Refusal as e:
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except EnvironmentFailure as e:
        cause = "".join(traceback.format_exception(e.__cause__)) if e.__cause__ is not None else ""
        print(f"{prog}: {e}\n\nThe environment's traceback:\n{cause}", file=sys.stderr, end="")
        raise SystemExit(1) from None
