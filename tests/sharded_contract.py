"""Run in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/test_sharding.py).

`python -m tests.sharded_contract contract`: a sampler replica on the last device generates; the
FSDP learner on 8, 4, 2 and 1 devices scores the same sequences; every logprob must have the
sampler's bits.

`python -m tests.sharded_contract grpo OUT`: the same GRPO run twice, with an 8-device FSDP learner
and 2 sampler replicas (OUT/fsdp) and with one device each (OUT/single); each writes metrics.jsonl
and its final fp32 master weights (master.npz) for the test to compare.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import rlkjax
from rlkjax import model
from tests.helpers import assert_bits_equal
from train import fsdp, grpo
from train.batch import pack, pad_rows

GRPO_RUN = dict(steps=2, prompts_per_step=4, group_size=4, max_new_tokens=4, micro_batch=8, progress=False)


def contract():
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    params = rlkjax.init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, int(rng.integers(1, 40))).tolist() for _ in range(6)]
    with jax.default_device(jax.devices()[7]):  # a sampler replica on its own device
        comps = rlkjax.generate(
            jax.device_put(params, jax.devices()[7]), cfg, prompts, max_new_tokens=6, seeds=list(range(6))
        )
    samples = [
        {"prompt": p, "tokens": c.tokens, "logprobs": c.logprobs, "adv": 0.0, "temperature": 1.0}
        for p, c in zip(prompts, comps)
    ]
    batch = pack(samples)
    master = jax.tree.map(lambda w: w.astype(jnp.float32), params)
    sel = batch.mask > 0
    for devices in (8, 4, 2, 1):
        mesh = fsdp.make_mesh(jax.devices()[:devices])
        specs = fsdp.param_specs(master, devices)
        score = fsdp.sharded_logprobs(grpo.policy_logprobs, mesh, specs, cfg=cfg, numerics="strict")
        mb = pad_rows(batch, devices)
        logp = np.asarray(
            score(fsdp.put(master, mesh, specs), mb.tokens, mb.positions, mb.temps, model.rope_tables(cfg))
        )
        assert_bits_equal(logp[: len(samples)][sel], batch.logp_old[sel], f"learner on {devices} devices vs sampler")
        print(f"learner on {devices} devices: {int(sel.sum())} logprobs, 0 differing bits", flush=True)


def grpo_runs(out: Path):
    for name, layout in {"fsdp": dict(learner_devices="0-7", sampler_devices="6,7"), "single": {}}.items():
        result = grpo.train(grpo.GRPOConfig(out=str(out / name), **GRPO_RUN, **layout))
        leaves = jax.tree_util.tree_leaves_with_path(result["master"])
        np.savez(out / name / "master.npz", **{jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves})
        print(f"grpo {name}: {len(result['history'])} steps", flush=True)


if __name__ == "__main__":
    assert len(jax.devices()) == 8, jax.devices()
    if sys.argv[1:] == ["contract"]:
        contract()
    elif sys.argv[1] == "grpo":
        grpo_runs(Path(sys.argv[2]))
    else:
        raise SystemExit(f"usage: python -m tests.sharded_contract contract | grpo OUT (got {sys.argv[1:]})")
