"""Run in a subprocess with fake CPU devices, XLA_FLAGS=--xla_force_host_platform_device_count=8
(tests/test_sharding.py; learner_step_matches_sampler also on GPUs, tests/test_gpu.py).

`python -m tests.sharded_contract learner-step` (2 devices are enough): train.grpo's learner step
on a 2-device mesh against the sampler, for short sequences and for sequences longer than one
attention KV split (learner_step_matches_sampler; tests/test_gpu.py runs the same on 2 GPUs).

`python -m tests.sharded_contract layouts OUT` (3 devices): short GRPO runs with the learner and the
samplers on different, overlapping or the same devices (LAYOUTS), each writing OUT/<learner>-<sampler>/
metrics.jsonl; one process for all, so what they share is traced once.

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
from rlkjax.numerics import ATTENTION
from tests.helpers import assert_bits_equal
from train import fsdp, grpo
from train.batch import pack, pad_rows

# learner devices, sampler devices
LAYOUTS = (
    ("0,1", "2"),  # learner on 2 devices, the sampler on a third
    ("0", "1,2"),  # learner on 1, samplers on 2 others
    ("0,1", "0,1"),  # both on both
)
LAYOUT_RUN = dict(steps=2, prompts_per_step=3, group_size=2, max_new_tokens=4, warmup_steps=0, progress=False)
GRPO_RUN = dict(steps=2, prompts_per_step=4, group_size=4, max_new_tokens=4, micro_batch=8, progress=False)


# Prompt lengths of the two cases: short rows (one attention split), and rows whose keys run past the
# first KV split (256 keys) in the sampler's prefill and decode and in the learner's pass, over 3 splits.
SHORT_PROMPTS = (1, 17, 64, 130)
LONG_PROMPTS = (250, 300, 520)


def learner_step_matches_sampler(cfg, params, devices, prompt_lens, max_new_tokens: int) -> dict:
    """train.grpo's learner step itself (fsdp.sharded_value_and_grad of grpo.grpo_loss, weights
    gathered as the policy's dtype, as train.grpo builds it) on a mesh of `devices`, against the
    sampler (rlkjax.generate on the default device): the step's own logp_new must have the
    sampler's bits on every completion token, so its ratio is exactly 1, and its gradient (random
    non-zero advantages) must be finite and non-zero. Returns what was compared."""
    rng = np.random.default_rng(len(prompt_lens))
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in prompt_lens]
    comps = rlkjax.generate(params, cfg, prompts, max_new_tokens=max_new_tokens, seeds=list(range(len(prompts))))
    samples = [
        {"prompt": p, "tokens": c.tokens, "logprobs": c.logprobs, "adv": float(a), "temperature": 1.0}
        for p, c, a in zip(prompts, comps, rng.standard_normal(len(prompts)))
    ]
    batch = pad_rows(pack(samples), len(devices))
    mesh = fsdp.make_mesh(devices)
    specs = fsdp.param_specs(params, len(devices))
    grad_fn = fsdp.sharded_value_and_grad(
        grpo.grpo_loss, mesh, specs, dtype=cfg.dtype, cfg=cfg, numerics="strict", clip_eps=0.2, beta=0.0
    )
    master = fsdp.put(params, mesh, specs, dtype=jnp.float32)
    (_, (stats, logp)), grads = grad_fn(
        master,
        fsdp.put(batch, mesh, fsdp.BATCH_SPECS),
        fsdp.put(np.zeros(batch.logp_old.shape, np.float32), mesh, fsdp.ROWS),
        fsdp.put(model.rope_tables(cfg), mesh, fsdp.REPLICATED),
        fsdp.put(np.float32(batch.mask.sum()), mesh, fsdp.REPLICATED),
        jax.tree.map(jnp.zeros_like, master),
    )
    sel = batch.mask > 0
    assert_bits_equal(np.asarray(logp)[sel], batch.logp_old[sel], f"learner step on {len(devices)} devices vs sampler")
    assert float(stats.ratio_min) == float(stats.ratio_max) == 1.0, stats
    norm = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(fsdp.to_host(grads))))
    assert np.isfinite(norm) and norm > 0, norm
    keys = max(len(s["prompt"]) + len(s["tokens"]) for s in samples)
    return {"logprobs": int(sel.sum()), "keys": keys, "kv_splits": -(-keys // ATTENTION.kv_split), "grad_norm": norm}


def learner_step():
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    params = rlkjax.init_params(cfg, seed=0)
    for name, lens in {"short": SHORT_PROMPTS, "long": LONG_PROMPTS}.items():
        result = learner_step_matches_sampler(cfg, params, jax.devices()[:2], lens, max_new_tokens=16)
        print(f"learner step, {name} rows: {result}", flush=True)


def layout_runs(out: Path):
    for learner, sampler in LAYOUTS:
        run = out / f"{learner}-{sampler}"
        grpo.train(grpo.GRPOConfig(out=str(run), learner_devices=learner, sampler_devices=sampler, **LAYOUT_RUN))
        print(f"layout {learner} / {sampler}: done", flush=True)


def grpo_runs(out: Path):
    for name, layout in {"fsdp": dict(learner_devices="0-7", sampler_devices="6,7"), "single": {}}.items():
        result = grpo.train(grpo.GRPOConfig(out=str(out / name), **GRPO_RUN, **layout))
        leaves = jax.tree_util.tree_leaves_with_path(result["master"])
        np.savez(out / name / "master.npz", **{jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves})
        print(f"grpo {name}: {len(result['history'])} steps", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["learner-step"]:
        learner_step()
    elif sys.argv[1] == "layouts":
        assert len(jax.devices()) == 3, jax.devices()
        layout_runs(Path(sys.argv[2]))
    elif sys.argv[1] == "grpo":
        assert len(jax.devices()) == 8, jax.devices()
        grpo_runs(Path(sys.argv[2]))
    else:
        usage = "python -m tests.sharded_contract learner-step | layouts OUT | grpo OUT"
        raise SystemExit(f"usage: {usage} (got {sys.argv[1:]})")
