"""POST /update_weights: load a checkpoint, check it against the served model, and swap it in between engine
steps; and the finiteness check the served weights pass at start-up too."""

import asyncio
from pathlib import Path

import jax
import jax.numpy as jnp
from aiohttp import web

from rlkjax.core.checkpoint import load_model
from rlkjax.core.checks import shown
from rlkjax.core.config import ModelConfig
from serve.auth import AdminAuth, admin_gate
from serve.config import ServerConfig
from serve.engine_client import EngineClient
from serve.http import BadRequest, check_fields, json_response, read_json


@jax.jit
def _all_finite(params):
    """One flag per leaf. One program for the whole tree, compiled at start-up (the served weights
    are checked there) and reused by every /update_weights: not an eager reduction per array."""
    return [jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(params)]


def non_finite(params) -> list[str]:
    """Paths of the parameters holding NaN or Inf."""
    flags = jax.device_get(_all_finite(params))
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)]
    return [path for path, ok in zip(paths, flags, strict=True) if not ok]


async def update_weights(client: EngineClient, admin: AdminAuth | None, config: ServerConfig, request: web.Request):
    """Swap in the checkpoint at the body's "path" once the admin key checks; answers the new policy_version."""
    refused = admin_gate(admin, request, "weight updates")
    if refused is not None:
        return refused
    body = check_fields(await read_json(request, config.read_timeout), {"path"}, {"path"})
    if not isinstance(body["path"], str):
        raise BadRequest("path must be a string")
    params = await asyncio.to_thread(load_update, body["path"], client.model_config)
    return json_response({"policy_version": await client.update_weights(params)})


def load_update(path: str, served: ModelConfig):
    """New weights for the served model, or BadRequest naming why not; the old weights stay.
    Refused: anything but a checkpoint directory (a preset name would build a random model), a
    checkpoint that does not load (corrupt safetensors or config.json, extra or missing
    tensors), other shapes, another dtype (float32 weights served in bfloat16's place would
    break sampler == learner), and non-finite values."""
    if served.lora is not None:
        raise BadRequest("this server serves a LoRA adapter on its base: swap adapters with /v1/load_lora_adapter")
    try:
        is_dir = Path(path).is_dir()
    except OSError as e:  # a name longer than the file system allows, say: the client's path, not a 500
        raise BadRequest(f"path {shown(path)}: {e.strerror}") from None
    if not is_dir:
        raise BadRequest(
            f"path {shown(path)} is not a checkpoint directory (HF: config.json + *.safetensors, or orbax: "
            "config.json + params/)"
        )
    try:
        cfg, params = load_model(path)
    except Exception as e:  # whatever a damaged upload raises is the caller's input problem, not a 500
        raise BadRequest(f"cannot load {shown(path)}: {type(e).__name__}: {e}") from None
    if cfg.replace_dtype(served.dtype) != served:
        raise BadRequest(f"checkpoint shapes {cfg} do not match the served model {served}")
    if cfg.dtype != served.dtype or any(leaf.dtype != jnp.dtype(served.dtype) for leaf in jax.tree.leaves(params)):
        raise BadRequest(f"checkpoint dtype {cfg.dtype} is not the served dtype {served.dtype}: cast it when saving")
    bad = non_finite(params)
    if bad:
        raise BadRequest(f"checkpoint has non-finite values in {', '.join(bad[:10])}")
    return params
