"""HF Qwen3 checkpoints: config.json + *.safetensors (one file or a sharded index), both ways.

Our params keep HF's names and [out, in] layout, so loading and saving only rename and stack:
a save/load round trip is bit-exact.
"""

import contextlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from rlkjax.core.config import PRESETS, ModelConfig, read_json
from rlkjax.core.model import layer_shapes

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


def _inside(directory: Path, name: str, what: str) -> Path:
    """directory / name, refused with a ValueError naming `what` unless it resolves (after symlinks)
    inside the directory: a checkpoint is one directory, and an index entry like `../other/x` or an
    absolute path used to load and serve a file from anywhere. One exception, the Hugging Face hub
    cache, whose snapshot directories hold symlinks into the same model's `blobs/`."""
    root, target = directory.resolve(), (directory / name).resolve()
    hub_blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    if target.is_relative_to(root) or (hub_blobs is not None and target.is_relative_to(hub_blobs)):
        return target
    raise ValueError(f"{what} {name!r} resolves to {target}, outside the checkpoint directory {root}")


def _shard_names(directory: Path) -> list[str]:
    """The safetensors files of a checkpoint: its index's weight_map values, or every *.safetensors."""
    if not (directory / INDEX).is_file():
        return sorted(p.name for p in directory.glob("*.safetensors"))
    weight_map = read_json(_inside(directory, INDEX, "file")).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{directory / INDEX} has no weight_map object")
    for tensor, fname in weight_map.items():
        if not isinstance(fname, str):
            raise ValueError(f"{INDEX} entry {tensor!r} names {fname!r}, not a file name")
    return sorted(set(weight_map.values()))


def load_hf_checkpoint(directory, dtype: str | None = None):
    """Read config.json and the safetensors weights -> (ModelConfig, params). Every file must resolve
    inside `directory`, and every tensor must be stored in the config's dtype (its torch_dtype), so
    nothing is rounded on the way in; `dtype` overrides the config's and casts deliberately."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ValueError(f"{directory} has no config.json; not an HF checkpoint directory")
    cfg = ModelConfig.from_hf_config(_inside(directory, "config.json", "file"), dtype=dtype)
    files = _shard_names(directory)
    if not files:
        raise ValueError(f"{directory} holds no *.safetensors files")
    wanted = hf_names(cfg)
    params, layers, unexpected, tied_head = {}, {name: [None] * cfg.num_layers for name in _LAYER_PREFIX}, [], None
    for fname in files:
        with _open_shard(_inside(directory, fname, f"{INDEX} entry")) as f:
            for name in f.keys():
                path = wanted.pop(name, None)
                if path is None:
                    if name == "lm_head.weight" and cfg.tie_embeddings:
                        tied_head = _stored_as(f, name, fname, cfg.dtype, dtype)  # HF may save the tied copy too
                    else:
                        unexpected.append(f"{name} ({fname})")
                    continue
                array = _stored_as(f, name, fname, cfg.dtype, dtype)
                if array.shape != _expected_shape(cfg, path):
                    raise ValueError(f"{name} has shape {array.shape}, config says {_expected_shape(cfg, path)}")
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


@contextlib.contextmanager
def _open_shard(path: Path):
    """safe_open(path), a missing or malformed file refused with a ValueError naming it (safetensors raises its
    own SafetensorError, and OSError)."""
    try:
        with safe_open(path, framework="flax") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


def _stored_as(f, name: str, fname: str, want: str, override: str | None):
    """Tensor `name` in `want`: stored so, or cast because the caller asked for `override`. A float32
    tensor in a checkpoint whose config says bfloat16 used to be rounded silently."""
    array = f.get_tensor(name)
    if array.dtype != jnp.dtype(want) and override is None:
        raise ValueError(
            f"{name} is stored as {array.dtype} in {fname}, the model's dtype (config.json's torch_dtype) is {want}: "
            f"save it in {want} "
            "(or load with dtype= to cast it deliberately)"
        )
    return jnp.asarray(array, want)


def _check_dtypes(cfg: ModelConfig, params) -> None:
    """Refuse to write params in another dtype than cfg's: the checkpoint's config.json would say one
    dtype and its tensors hold another, which loading refuses."""
    for key, leaf in jax.tree_util.tree_leaves_with_path(params):
        if leaf.dtype != jnp.dtype(cfg.dtype):
            raise ValueError(f"params{jax.tree_util.keystr(key)} is {leaf.dtype}, the config's dtype is {cfg.dtype}")


def save_hf_checkpoint(directory, cfg: ModelConfig, params, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write config.json and safetensors shards (with an index when there is more than one)."""
    _check_dtypes(cfg, params)
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

    _check_dtypes(cfg, params)
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_hf_config(), indent=2))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / "params", params, force=True)


def load_model(spec: str, seed: int = 0):
    """A preset name (random weights from `seed`), an HF checkpoint directory, or an orbax directory
    (config.json + params/, as written by save_orbax_params and train.grpo) -> (cfg, params)."""
    from rlkjax.core.model import init_params

    if spec in PRESETS:
        cfg = ModelConfig.preset(spec)
        return cfg, init_params(cfg, seed=seed)
    path = Path(spec)
    if (path / "params").is_dir() and (path / "config.json").is_file():
        import orbax.checkpoint as ocp

        cfg = ModelConfig.from_hf_config(path / "config.json")
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), jax.eval_shape(lambda: init_params(cfg))
        )
        with ocp.StandardCheckpointer() as ckptr:
            stored = ckptr.metadata(path.absolute() / "params").item_metadata
            for key, leaf in jax.tree_util.tree_leaves_with_path(stored):
                if jnp.dtype(leaf.dtype) != jnp.dtype(cfg.dtype):  # orbax would cast it to the target's dtype
                    raise ValueError(
                        f"{jax.tree_util.keystr(key)} is stored as {leaf.dtype} in {path / 'params'}, the model's "
                        f"dtype (config.json's torch_dtype) is {cfg.dtype}: save it in {cfg.dtype}"
                    )
            return cfg, ckptr.restore(path.absolute() / "params", target)
    if path.is_dir():
        return load_hf_checkpoint(path)
    raise ValueError(f"model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a checkpoint directory")
