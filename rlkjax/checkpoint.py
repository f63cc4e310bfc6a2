"""HF Qwen3 checkpoints: config.json + *.safetensors (one file or a sharded index), both ways.

Our params keep HF's names and [out, in] layout, so loading and saving only rename and stack:
a save/load round trip is bit-exact.
"""

import json
from pathlib import Path

import jax.numpy as jnp
from safetensors import safe_open
from safetensors.flax import save_file

from rlkjax.config import PRESETS, ModelConfig
from rlkjax.model import layer_shapes

_LAYER_PREFIX = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
INDEX = "model.safetensors.index.json"


def hf_names(cfg: ModelConfig) -> dict[str, tuple]:
    """HF tensor name -> path into our params pytree."""
    names = {"model.embed_tokens.weight": ("embed_tokens",), "model.norm.weight": ("norm",)}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = ("lm_head",)
    for i in range(cfg.num_layers):
        for ours, theirs in _LAYER_PREFIX.items():
            names[f"model.layers.{i}.{theirs}.weight"] = ("layers", i, ours)
    return names


def _expected_shape(cfg, path):
    if path[0] == "layers":  # one layer's slice of the stacked array
        return layer_shapes(cfg)[path[2]]
    return (cfg.hidden_size,) if path[0] == "norm" else (cfg.vocab_size, cfg.hidden_size)


def load_hf_checkpoint(directory, dtype: str | None = None):
    """Read config.json and the safetensors weights -> (ModelConfig, params)."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ValueError(f"{directory} has no config.json; not an HF checkpoint directory")
    cfg = ModelConfig.from_hf_config(directory / "config.json", dtype=dtype)
    if (directory / INDEX).is_file():
        files = sorted(set(json.loads((directory / INDEX).read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} holds no *.safetensors files")
    wanted = hf_names(cfg)
    params, layers, unexpected, tied_head = {}, {name: [None] * cfg.num_layers for name in _LAYER_PREFIX}, [], None
    for fname in files:
        with safe_open(directory / fname, framework="flax") as f:
            for name in f.keys():
                path = wanted.pop(name, None)
                if path is None:
                    if name == "lm_head.weight" and cfg.tie_embeddings:
                        tied_head = jnp.asarray(f.get_tensor(name), cfg.dtype)  # HF may save the tied copy too
                    else:
                        unexpected.append(f"{name} ({fname})")
                    continue
                array = f.get_tensor(name)
                if array.shape != _expected_shape(cfg, path):
                    raise ValueError(f"{name} has shape {array.shape}, config says {_expected_shape(cfg, path)}")
                array = jnp.asarray(array, cfg.dtype)
                if path[0] == "layers":
                    layers[path[2]][path[1]] = array
                else:
                    params[path[0]] = array
    if unexpected:
        raise ValueError(
            f"checkpoint {directory} holds {len(unexpected)} tensors a Qwen3 model with this config.json does "
            f"not have: {', '.join(sorted(unexpected)[:20])}{' ...' if len(unexpected) > 20 else ''}"
        )
    if wanted:
        raise ValueError(f"checkpoint {directory} is missing {len(wanted)} tensors, e.g. {next(iter(wanted))}")
    if tied_head is not None and not bool(jnp.all(tied_head == params["embed_tokens"])):
        raise ValueError(
            f"checkpoint {directory} says tie_word_embeddings but its lm_head.weight differs from "
            "model.embed_tokens.weight: which one to use is ambiguous"
        )
    params["layers"] = {name: jnp.stack(arrays) for name, arrays in layers.items()}
    return cfg, params


def save_hf_checkpoint(directory, cfg: ModelConfig, params, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write config.json and safetensors shards (with an index when there is more than one)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, path in hf_names(cfg).items():
        tensors[name] = params["layers"][path[2]][path[1]] if path[0] == "layers" else params[path[0]]
    shards, current, size = [], {}, 0
    for name, array in tensors.items():
        if current and size + array.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
    shards.append(current)
    (directory / "config.json").write_text(json.dumps(cfg.to_hf_config(), indent=2))
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(a.nbytes for a in tensors.values())
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def save_orbax_params(directory, cfg: ModelConfig, params) -> None:
    """Params as an orbax checkpoint (`params/`) plus the model's config.json."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_hf_config(), indent=2))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / "params", params, force=True)


def load_model(spec: str, seed: int = 0):
    """A preset name (random weights from `seed`), an HF checkpoint directory, or an orbax directory
    (config.json + params/, as written by save_orbax_params and train.grpo) -> (cfg, params)."""
    from rlkjax.model import init_params

    if spec in PRESETS:
        cfg = ModelConfig.preset(spec)
        return cfg, init_params(cfg, seed=seed)
    path = Path(spec)
    if (path / "params").is_dir() and (path / "config.json").is_file():
        import jax
        import orbax.checkpoint as ocp

        cfg = ModelConfig.from_hf_config(path / "config.json")
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), jax.eval_shape(lambda: init_params(cfg))
        )
        with ocp.StandardCheckpointer() as ckptr:
            return cfg, ckptr.restore(path.absolute() / "params", target)
    if path.is_dir():
        return load_hf_checkpoint(path)
    raise ValueError(f"model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a checkpoint directory")
