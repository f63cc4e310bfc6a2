"""Model shapes: one frozen dataclass, presets for the real Qwen3 dense sizes, and HF config.json; and the LoRA
adapters a model may carry (`LoraConfig`)."""

import dataclasses
import json
from pathlib import Path

# The projections an adapter can target, by their HF (and PEFT) module names.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters on the model's projections: y = x W^T + (alpha / rank) (x A^T) B^T, W frozen, A [rank, in]
    and B [out, rank] trained (rlkjax/core/lora.py). The defaults are TRL's (r 16, alpha 32) on every linear
    projection of the decoder layers (PEFT's "all-linear"; PEFT's own default r 8, alpha 8 on q_proj and v_proj
    only trains far less of the model)."""

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        if self.rank <= 0:
            raise ValueError(f"LoRA rank={self.rank} must be positive")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha={self.alpha} must be positive")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoRA targets {list(self.targets)}: name each of {list(LORA_TARGETS)} at most once")

    @property
    def scale(self) -> float:
        """alpha / rank, applied inside the kernels (pallas_kernels/lora.py), whatever its value."""
        return float(self.alpha) / self.rank


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_embeddings: bool
    max_position: int = 40960
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    dtype: str = "bfloat16"  # weights, activations and the KV cache
    lora: LoraConfig | None = None  # adapters on the projections (params["layers"] then holds them), or none

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates halves)")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype={self.dtype!r} must be 'bfloat16' or 'float32'")
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ValueError(f"lora={self.lora!r} must be a LoraConfig or None")

    def replace_dtype(self, dtype: str) -> "ModelConfig":
        return dataclasses.replace(self, dtype=dtype)

    @staticmethod
    def preset(name: str) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[name]

    @staticmethod
    def from_hf_config(config: dict | str | Path, dtype: str | None = None) -> "ModelConfig":
        """From a Qwen3 `config.json` (a dict or its path). A ValueError says what is wrong, naming the file."""
        if not isinstance(config, dict):
            path = config
            try:
                return ModelConfig.from_hf_config(read_json(path), dtype)
            except ValueError as e:
                raise ValueError(e if str(path) in str(e) else f"{path}: {e}") from None
        missing = [k for k in HF_REQUIRED if not isinstance(config.get(k), int)]
        if missing:
            raise ValueError(f"no integer {missing[0]!r}; a Qwen3 config.json gives {', '.join(HF_REQUIRED)}")
        if config.get("model_type", "qwen3") != "qwen3":
            raise ValueError(f"model_type {config.get('model_type')!r} is not qwen3")
        _check_hf_features(config)
        hf_dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        return ModelConfig(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            # Absent: Qwen3Config's default 128 (not hidden / heads); null: the rotary embedding's hidden / heads.
            head_dim=config.get("head_dim", 128) or config["hidden_size"] // config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position=config.get("max_position_embeddings", 40960),
            rope_theta=_rope_theta(config),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            dtype=dtype or ("float32" if hf_dtype == "float32" else "bfloat16"),
        )

    def to_hf_config(self) -> dict:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "attention_bias": False,
            "torch_dtype": self.dtype,
        }


HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def read_json(path) -> dict:
    """A JSON object file (config.json, tokenizer_config.json); a ValueError names the file and what is wrong."""
    try:
        value = json.loads(Path(path).read_bytes())
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _rope_theta(config: dict) -> float:
    """RoPE's base from either config.json layout: transformers v4 writes a top-level `rope_theta`
    (and `rope_scaling`, null for plain RoPE); v5 writes `rope_parameters: {"rope_type", "rope_theta"}`.
    Only the default (unscaled) RoPE is implemented: a scaled one would silently change every
    position's angles, so it is refused by name."""
    scaling = config.get("rope_scaling") or {}
    params = config.get("rope_parameters") or {}
    for where, spec in (("rope_scaling", scaling), ("rope_parameters", params)):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{where} asks for rope_type {kind!r}; only the default RoPE is implemented")
    # Absent from both: Qwen3Config's own default (10000), which is what transformers would run.
    return float(params.get("rope_theta", config.get("rope_theta", 10_000.0)))


def _check_hf_features(config: dict) -> None:
    """Qwen3Config options that change the model beyond its shapes and are not implemented: refuse
    them by name rather than run a different model."""
    if config.get("attention_bias", False):
        raise ValueError("attention_bias=true (biases on q/k/v/o projections) is not implemented")
    if config.get("use_sliding_window", False) or any(t != "full_attention" for t in config.get("layer_types") or []):
        raise ValueError("sliding-window attention layers are not implemented (use_sliding_window / layer_types)")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not implemented; only 'silu' (SwiGLU)")


PRESETS = {
    # Small enough for interpret-mode tests on a 2-core CPU; head_dim 16 is Triton's smallest dot.
    "qwen3-tiny": ModelConfig(512, 64, 2, 4, 2, 16, 128, tie_embeddings=True, max_position=1024),
    "qwen3-0.6b": ModelConfig(151936, 1024, 28, 16, 8, 128, 3072, tie_embeddings=True),
    "qwen3-1.7b": ModelConfig(151936, 2048, 28, 16, 8, 128, 6144, tie_embeddings=True),
    "qwen3-4b": ModelConfig(151936, 2560, 36, 32, 8, 128, 9728, tie_embeddings=True),
    "qwen3-8b": ModelConfig(151936, 4096, 36, 32, 8, 128, 12288, tie_embeddings=False),
    # Qwen/Qwen3-14B and Qwen/Qwen3-32B's config.json (shapes only).
    "qwen3-14b": ModelConfig(151936, 5120, 40, 40, 8, 128, 17408, tie_embeddings=False),
    "qwen3-32b": ModelConfig(151936, 5120, 64, 64, 8, 128, 25600, tie_embeddings=False),
}
