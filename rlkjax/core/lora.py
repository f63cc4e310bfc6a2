"""LoRA adapters in the params pytree, and in PEFT's files.

An adapted model is its base params plus, in params["layers"], two stacks per targeted projection:
  "{target}.lora_A" [L, rank, in] and "{target}.lora_B" [L, out, rank]
(PEFT's [r, in] / [out, r] per layer, stacked like every layer weight), with cfg.lora saying rank, alpha and
targets. `model.forward` sees the stacks and runs pallas_kernels/lora.py's adapted projection for those targets,
in the sampler's programs and in the learner's alike: the contract holds unchanged. The learner trains only the
adapters (`split`): the base stays frozen in the policy's dtype.

PEFT's layout (`save_peft`, `load_peft`): adapter_config.json + adapter_model.safetensors with tensor names
base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight [r, in] (lora_B [out, r]), as
`PeftModel.save_pretrained` writes them; no torch or peft needed.
"""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.flax import load_file
from safetensors.numpy import save_file

from rlkjax.core.config import LoraConfig, ModelConfig

SUFFIXES = (".lora_A", ".lora_B")
# Our projection names -> their module paths inside a decoder layer (HF's and PEFT's).
MODULES = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def is_adapter(name: str) -> bool:
    return name.endswith(SUFFIXES)


def adapter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{"q_proj.lora_A": (L, r, in), "q_proj.lora_B": (L, out, r), ...} for cfg.lora's targets."""
    from rlkjax.core.model import layer_shapes

    if cfg.lora is None:
        raise ValueError("the model config has no LoRA (cfg.lora is None)")
    r, shapes = cfg.lora.rank, layer_shapes(cfg)
    out = {}
    for target in cfg.lora.targets:
        n_out, n_in = shapes[target]
        out[f"{target}.lora_A"] = (cfg.num_layers, r, n_in)
        out[f"{target}.lora_B"] = (cfg.num_layers, n_out, r)
    return out


def init_adapters(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32) -> dict:
    """{"layers": {adapter stacks}} as PEFT initialises them: A uniform in +-1/sqrt(in) (kaiming_uniform with
    a = sqrt(5), torch's Linear default), B zeros, so the adapted model starts as the base model."""
    rng = np.random.default_rng(seed)
    layers = {}
    for name, shape in adapter_shapes(cfg).items():
        if name.endswith(".lora_A"):
            bound = 1.0 / np.sqrt(shape[2])
            layers[name] = jnp.asarray(rng.uniform(-bound, bound, shape).astype(np.float32), dtype)
        else:
            layers[name] = jnp.zeros(shape, dtype)
    return {"layers": layers}


def split(params) -> tuple[dict, dict]:
    """params -> (the frozen base, {"layers": the adapters}); `merge` undoes it."""
    layers = params["layers"]
    frozen = {**params, "layers": {k: v for k, v in layers.items() if not is_adapter(k)}}
    return frozen, {"layers": {k: v for k, v in layers.items() if is_adapter(k)}}


def merge(frozen, adapters) -> dict:
    """The adapted params: the base with the adapters' stacks beside its own (no arithmetic)."""
    if not adapters:
        return frozen
    return {**frozen, "layers": {**frozen["layers"], **adapters["layers"]}}


def check(cfg: ModelConfig, params) -> None:
    """Refuse params whose adapters do not match cfg.lora (absent, extra, or shaped otherwise)."""
    have = {k: tuple(v.shape) for k, v in params["layers"].items() if is_adapter(k)}
    want = adapter_shapes(cfg) if cfg.lora is not None else {}
    if have != want:
        raise ValueError(f"the params' adapters {have} do not match the model config's LoRA {cfg.lora}: {want}")


def merged_weights(cfg: ModelConfig, params) -> dict:
    """The base params with each target's W + (alpha / r) B @ A folded in, adapters removed, as host (numpy)
    arrays: a plain Hugging Face model for other stacks. Each layer is summed in float64 on the host and cast to
    the model's dtype before the next (a whole 32B stack in float64 would take 8 bytes a weight). Not the strict
    path: the adapted model's bits come from running the adapters unmerged."""
    frozen, adapters = split(params)
    layers, dtype = dict(frozen["layers"]), jnp.dtype(cfg.dtype)
    for target in cfg.lora.targets:
        a, b = (np.asarray(adapters["layers"][f"{target}.lora_{x}"], np.float64) for x in "AB")
        stack = np.asarray(jax.device_get(layers[target]))
        layers[target] = np.stack(
            [(stack[i].astype(np.float64) + cfg.lora.scale * (b[i] @ a[i])).astype(dtype) for i in range(len(stack))]
        )
    return {**frozen, "layers": layers}


# ----- PEFT's files -----
def peft_name(layer: int, target: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{MODULES[target]}.lora_{which}.weight"


def peft_config(lora: LoraConfig, base_model: str | None) -> dict:
    """adapter_config.json's keys as PEFT's LoraConfig writes them (no dropout, no bias, no rsLoRA/DoRA)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha,  # PEFT writes an int
        "target_modules": list(lora.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "lora_bias": False,
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "exclude_modules": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_peft(directory, cfg: ModelConfig, params, base_model: str | None = None) -> None:
    """The adapters of `params` as PEFT's adapter_config.json + adapter_model.safetensors (float32, as
    trained)."""
    check(cfg, params)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    layers = jax.device_get(params["layers"])
    for target in cfg.lora.targets:
        for which in "AB":
            stack = np.asarray(layers[f"{target}.lora_{which}"], np.float32)
            for i in range(cfg.num_layers):
                tensors[peft_name(i, target, which)] = np.ascontiguousarray(stack[i])
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
    (directory / CONFIG).write_text(json.dumps(peft_config(cfg.lora, base_model), indent=2))


def load_peft(directory, cfg: ModelConfig, dtype=jnp.float32) -> tuple[ModelConfig, dict]:
    """A PEFT LoRA adapter directory for a model of cfg's shapes -> (cfg with its LoraConfig, {"layers": the
    adapter stacks} in `dtype`). Refuses what it would not run as written: other PEFT types, DoRA, rsLoRA,
    per-module ranks, biases, targets outside the decoder's projections, missing or misshapen tensors."""
    directory = Path(directory)
    config = json.loads((directory / CONFIG).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{directory / CONFIG}: peft_type {config.get('peft_type')!r} is not 'LORA'")
    for key in ("use_dora", "use_rslora", "fan_in_fan_out", "lora_bias", "use_qalora", "use_bdlora"):
        if config.get(key):
            raise ValueError(f"{directory / CONFIG}: {key}=true is not supported")
    unsupported = ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save", "exclude_modules")
    unsupported += ("layer_replication", "trainable_token_indices", "target_parameters", "alora_invocation_tokens")
    for key in unsupported:
        if config.get(key):
            raise ValueError(f"{directory / CONFIG}: {key}={config[key]!r} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{directory / CONFIG}: bias={config['bias']!r} is not supported (only 'none')")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = list(MODULES) if targets == "all-linear" else [targets]
    lora = LoraConfig(config["r"], float(config["lora_alpha"]), tuple(t for t in MODULES if t in targets))
    if set(targets) != set(lora.targets):
        raise ValueError(f"{directory / CONFIG}: target_modules {targets} name modules outside {list(MODULES)}")
    cfg = dataclasses.replace(cfg, lora=lora)
    tensors = load_file(str(directory / WEIGHTS))
    layers = {}
    for name, shape in adapter_shapes(cfg).items():
        target, which = name.split(".lora_")
        per_layer = []
        for i in range(cfg.num_layers):
            key = peft_name(i, target, which)
            if key not in tensors or tuple(tensors[key].shape) != shape[1:]:
                got = tuple(tensors[key].shape) if key in tensors else "missing"
                raise ValueError(f"{directory / WEIGHTS}: {key} is {got}, expected {shape[1:]}")
            per_layer.append(tensors.pop(key))
        layers[name] = jnp.stack(per_layer).astype(dtype)
    if tensors:
        raise ValueError(f"{directory / WEIGHTS}: tensors this model has no place for: {sorted(tensors)[:5]}")
    return cfg, {"layers": layers}
