"""Run in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/test_sharding.py):
a sampler replica on the last device generates; the FSDP learner on 8, 4, 2 and 1 devices scores
the same sequences; every logprob must have the sampler's bits."""
import jax
import jax.numpy as jnp
import numpy as np

import rlkjax
from rlkjax import model
from tests.conftest import assert_bits_equal
from train import fsdp, grpo
from train.batch import pack, pad_rows

assert len(jax.devices()) == 8, jax.devices()
cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
params = rlkjax.init_params(cfg, seed=0)
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 256, int(rng.integers(1, 40))).tolist() for _ in range(6)]
with jax.default_device(jax.devices()[7]):  # a sampler replica on its own device
    comps = rlkjax.generate(jax.device_put(params, jax.devices()[7]), cfg, prompts, max_new_tokens=6, seeds=list(range(6)))
samples = [{"prompt": p, "tokens": c.tokens, "logprobs": c.logprobs, "adv": 0.0, "temperature": 1.0} for p, c in zip(prompts, comps)]
batch = pack(samples)
master = jax.tree.map(lambda w: w.astype(jnp.float32), params)
for devices in (8, 4, 2, 1):
    mesh = fsdp.make_mesh(devices)
    specs = fsdp.param_specs(master, devices)
    score = fsdp.sharded_logprobs(grpo.policy_logprobs, mesh, specs, cfg=cfg, numerics="strict")
    mb = pad_rows(batch, devices)
    logp = np.asarray(score(fsdp.shard(master, mesh, specs), mb.tokens, mb.positions, mb.temps, model.rope_tables(cfg)))
    sel = batch.mask > 0
    assert_bits_equal(logp[: len(samples)][sel], batch.logp_old[sel], f"learner on {devices} devices vs sampler")
    print(f"learner on {devices} devices: {int(sel.sum())} logprobs, 0 differing bits", flush=True)
