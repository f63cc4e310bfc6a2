"""The rollout server with LoRA: `serve.rollout --lora-adapter DIR` serves base + adapter with the learner's bits, and
POST /v1/load_lora_adapter (vLLM's body, the admin key) swaps in another adapter, bumping the policy version, as
train.grpo --rollout-url pushes its adapters each step. Prevents: a server that samples the base while the
learner scores the adapted model, an adapter of another shape or an unauthenticated swap taken silently, and a
/v1/models that does not list the adapter served."""

import dataclasses
import json
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlkjax
from rlkjax.core import lora
from rlkjax.core.config import LoraConfig
from tests.helpers import assert_bits_equal
from tests.server_process import ADMIN, post_raw, start_server
from train.rollout import RemoteRollout

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40))]


def adapter(cfg, seed: int):
    """Adapters of cfg.lora with B drawn non-zero (in the policy's dtype: what the learner samples with)."""
    layers = lora.init_adapters(cfg, seed)["layers"]
    rng = np.random.default_rng(seed)
    layers = {
        k: v if k.endswith("lora_A") else jnp.asarray(rng.normal(0, 0.05, v.shape), jnp.float32)
        for k, v in layers.items()
    }
    return jax.tree.map(lambda w: w.astype(cfg.dtype), {"layers": layers})


def listed(client) -> list[tuple]:
    """GET /v1/models: (id, parent, root) of each card."""
    with urllib.request.urlopen(client.url + "/v1/models", timeout=60) as r:
        return [(card["id"], card.get("parent"), card.get("root")) for card in json.load(r)["data"]]


def check_served(client, params, cfg, version: int):
    """Sampled by the server == scored here with `params`, bit for bit, on policy `version`."""
    results = client.generate(PROMPTS, max_tokens=4, temperature=1.0, seed=[0, 1])
    seqs = [p + r[0]["tokens"] for p, r in zip(PROMPTS, results)]
    scored = rlkjax.score(params, cfg, seqs, [len(p) for p in PROMPTS], temperature=1.0)
    for r, s in zip(results, scored):
        assert r[0]["policy_version"] == version
        assert_bits_equal(s, r[0]["logprobs"], f"served vs scored, version {version}")


@pytest.mark.slow
def test_served_adapter_and_its_swap_keep_the_contract(tmp_path):
    base_cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    base = rlkjax.init_params(base_cfg, seed=0)
    cfg = dataclasses.replace(base_cfg, lora=LoraConfig(rank=4, alpha=12.0))
    first, second = adapter(cfg, 1), adapter(cfg, 2)
    lora.save_peft(tmp_path / "first", cfg, first)
    lora.save_peft(
        tmp_path / "other_rank",
        dataclasses.replace(cfg, lora=LoraConfig(rank=8)),
        adapter(dataclasses.replace(cfg, lora=LoraConfig(rank=8)), 3),
    )
    proc, client = start_server("--model", "qwen3-tiny", "--lora-adapter", str(tmp_path / "first"))
    try:
        check_served(client, lora.merge(base, first), cfg, 0)
        assert listed(client) == [("qwen3-tiny", None, None), ("first", "qwen3-tiny", str(tmp_path / "first"))]
        body = json.dumps({"lora_name": "x", "lora_path": str(tmp_path / "other_rank")}).encode()
        status, answer = post_raw(client, "/v1/load_lora_adapter", body)
        assert status == 401, answer  # no admin key
        status, answer = post_raw(client, "/v1/load_lora_adapter", body, {"Authorization": f"Bearer {ADMIN}"})
        assert status == 400 and "rank=8" in answer["error"]["message"], answer
        status, answer = post_raw(
            client,
            "/update_weights",
            json.dumps({"path": str(tmp_path)}).encode(),
            {"Authorization": f"Bearer {ADMIN}"},
        )
        assert status == 400 and "/v1/load_lora_adapter" in answer["error"]["message"], answer
        # train.grpo --rollout-url's push: the adapters as PEFT files, then the route
        RemoteRollout(client.url, ADMIN).push(lora.merge(base, second), cfg, tmp_path / "run")
        check_served(client, lora.merge(base, second), cfg, 1)
        pushed = str((tmp_path / "run" / "sync_adapter").absolute())
        assert listed(client) == [("qwen3-tiny", None, None), ("policy", "qwen3-tiny", pushed)]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
