"""rlkjax: GRPO for Qwen3-style models where sampler and learner logprobs agree bit for bit."""

from rlkjax.core.numerics import quiet_rocm_plugin_without_gpu, set_xla_flags

set_xla_flags()  # before anything below can start a JAX backend
quiet_rocm_plugin_without_gpu()

from rlkjax.api import generate, score  # noqa: E402
from rlkjax.core.checkpoint import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from rlkjax.core.config import PRESETS, LoraConfig, ModelConfig  # noqa: E402
from rlkjax.core.model import (  # noqa: E402
    LearnerPass,
    Sequences,
    forward,
    init_params,
    sequence_logprobs,
    token_logprobs,
)
from rlkjax.core.sampling_params import SamplingParams  # noqa: E402
from rlkjax.engine.config import EngineConfig  # noqa: E402
from rlkjax.engine.engine import Engine  # noqa: E402
from rlkjax.engine.records import Completion  # noqa: E402

__all__ = [
    "PRESETS",
    "Completion",
    "Engine",
    "EngineConfig",
    "LearnerPass",
    "LoraConfig",
    "ModelConfig",
    "SamplingParams",
    "Sequences",
    "forward",
    "generate",
    "init_params",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
    "score",
    "sequence_logprobs",
    "token_logprobs",
]
