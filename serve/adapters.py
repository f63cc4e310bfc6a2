"""LoRA adapters on the server: the one served at start (--lora-adapter, a PEFT directory) and
POST /v1/load_lora_adapter, in vLLM's request shape ({"lora_name", "lora_path"}), which swaps in another adapter
of the same rank, alpha and targets between engine steps, as /update_weights swaps weights (same admin key, same
policy_version bump; no completion mixes two adapters). The engine runs base + adapters unmerged through the
learner's kernels, so served logprobs keep the contract with `rlkjax.score` of the same base and adapter.

One adapter is served at a time: a load replaces it (vLLM keeps several, chosen per request by `model`). GET
/v1/models lists it after the base, as vLLM lists a loaded adapter: its name (the --lora-adapter directory's, or the
last load's lora_name), "parent" the base and "root" its path.
"""

import asyncio
import dataclasses
from pathlib import Path

import jax
from aiohttp import web

from rlkjax.core import lora
from rlkjax.core.checks import shown
from rlkjax.core.config import ModelConfig
from serve.auth import AdminAuth, admin_gate
from serve.config import ServerConfig
from serve.engine_client import EngineClient
from serve.http import BadRequest, check_fields, json_response, read_json
from serve.weights import non_finite


@dataclasses.dataclass
class Served:
    """The adapter served now: its name and directory, as GET /v1/models lists them."""

    name: str
    path: str

    @classmethod
    def at_start(cls, directory: str) -> "Served":
        return cls(Path(directory).name, str(Path(directory).absolute()))


def adapted(cfg: ModelConfig, params, directory: str):
    """(cfg, params) of the base with the PEFT adapter in `directory` beside it (in the base's dtype, as the
    learner's policy holds it) -> the adapted (cfg, params). ValueError naming what does not fit."""
    cfg, adapters = lora.load_peft(directory, cfg)
    adapters = jax.tree.map(lambda w: w.astype(cfg.dtype), adapters)
    bad = non_finite(adapters)
    if bad:
        raise ValueError(f"adapter {directory}: non-finite values in {', '.join(bad[:10])}")
    return cfg, lora.merge(params, adapters)


def load_swap(path: str, served: ModelConfig, base):
    """The served base with the adapter at `path`, or BadRequest naming why not (the old adapter stays): it must
    load, and have the served adapter's rank, alpha and targets (another would be another model's programs)."""
    try:
        is_dir = Path(path).is_dir()
    except OSError as e:
        raise BadRequest(f"lora_path {shown(path)}: {e.strerror}") from None
    if not is_dir:
        raise BadRequest(f"lora_path {shown(path)} is not a PEFT adapter directory (adapter_config.json + safetensors)")
    try:
        cfg, params = adapted(dataclasses.replace(served, lora=None), base, path)
    except Exception as e:  # a damaged or foreign adapter is the caller's input problem, not a 500
        raise BadRequest(f"cannot load the adapter {shown(path)}: {type(e).__name__}: {e}") from None
    if cfg.lora != served.lora:
        raise BadRequest(f"adapter {shown(path)} is {cfg.lora}; this server serves {served.lora}")
    return params


async def load_lora_adapter(client: EngineClient, admin: AdminAuth | None, config: ServerConfig, served, request):
    """vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path"[, "load_inplace"]}: swap in the adapter once
    the admin key checks, and record it in `served` (a Served); answers {"lora_name", "policy_version"}."""
    refused = admin_gate(admin, request, "adapter loads")
    if refused is not None:
        return refused
    if client.model_config.lora is None:
        raise BadRequest("this server serves no LoRA adapter: start it with --lora-adapter DIR to swap adapters")
    body = await read_json(request, config.read_timeout)
    body = check_fields(body, {"lora_name", "lora_path", "load_inplace"}, {"lora_name", "lora_path"})
    if not isinstance(body["lora_name"], str) or not isinstance(body["lora_path"], str):
        raise BadRequest("lora_name and lora_path must be strings")
    base, _ = lora.split(client.params)
    params = await asyncio.to_thread(load_swap, body["lora_path"], client.model_config, base)
    version = await client.update_weights(params)
    served.name, served.path = body["lora_name"], str(Path(body["lora_path"]).absolute())
    return json_response({"lora_name": body["lora_name"], "policy_version": version})


def routes(client: EngineClient, admin: AdminAuth | None, config: ServerConfig, served: Served | None) -> list:
    route = lambda request: load_lora_adapter(client, admin, config, served, request)  # noqa: E731
    return [web.post("/v1/load_lora_adapter", route)]
