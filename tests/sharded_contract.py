"""What tests/test_sharding.py checks, run in one subprocess on 8 fake CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8, fixed when JAX starts; learner_step_matches_sampler
also runs on GPUs, tests/test_gpu.py).

`python -m tests.sharded_contract OUT [PART ...]` runs the named parts (all of PARTS by default) one
after another, each writing OUT/PART/: result.json on success, error.txt (the traceback) on failure,
so one part's failure leaves the others' results. One process for all: what they share (the model's
initialisation, the engines' step functions, the learner's programs on a mesh they have in common)
is compiled or loaded once, and Python and JAX start once.

  learner-step: train.grpo's learner step on a 2-device mesh against the sampler, for short sequences
    and for sequences longer than one attention KV split (learner_step_matches_sampler).
  layouts: short GRPO runs with the learner and the samplers on different, overlapping or the same
    devices (LAYOUTS), each writing layouts/<learner>-<sampler>/metrics.jsonl.
  grpo: the same GRPO run twice, with an 8-device FSDP learner and 2 sampler replicas (grpo/fsdp) and
    with one device each (grpo/single); each writes metrics.jsonl and its final fp32 master weights
    (master.npz).
  memory, remat, 8b: the learner step's compiled memory (bench/learner_memory.py: lowered and compiled
    with abstract inputs, never run) per layer, without --remat (memory) and with it (remat), and
    Qwen3-8B's learner step and AdamW update compiled for 8 devices.
"""

import dataclasses
import json
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import rlkjax
from bench.learner_memory import compiled_memory, learner_programs, memory, shard_sizes
from rlkjax.core import model
from rlkjax.core.config import ModelConfig
from rlkjax.core.numerics import ATTENTION
from tests.helpers import assert_bits_equal
from train import fsdp, grpo
from train.batch import as_sample, pack, pad_rows
from train.config import Optimiser
from train.loss import Objective, grpo_loss

GRPO_RUN = dict(steps=2, prompts_per_step=4, group_size=4, max_new_tokens=4, micro_batch_tokens=64, progress=False)
# The layouts' runs are GRPO_RUN's with a first update that moves the weights (no warmup), so a sampler
# left with stale weights samples step 2 from another policy than the learner's and the rescoring differs.
LAYOUT_RUN = GRPO_RUN | dict(optimiser=Optimiser(warmup_steps=0))
# learner devices, sampler devices. XLA:CPU compiles a program for the devices it runs on, so the
# devices repeat grpo_runs' where they can, and the runs share their programs: the sampler on device 0
# (16 rows, one sampler) is grpo/single's, the samplers on 6 and 7 (8 rows each) are grpo/fsdp's, the
# learner on device 0 is grpo/single's (its update differs: no warmup).
LAYOUTS = (
    ("6,7", "0"),  # learner on 2 devices, the sampler on a third
    ("0", "6,7"),  # learner on 1, samplers on 2 others
    ("6,7", "6,7"),  # both on both
)
# The learner step's temporaries per layer (memory_per_layer): wide layers, few tokens, so the weights
# dominate the activations.
WIDE = dataclasses.replace(ModelConfig.preset("qwen3-tiny"), hidden_size=256, intermediate_size=1024)


# Prompt lengths of the two cases: short rows (one attention split), and rows whose keys run past the
# first KV split (256 keys) in the sampler's prefill and decode and in the learner's pass, over 3 splits.
SHORT_PROMPTS = (1, 17, 64, 130)
LONG_PROMPTS = (250, 300, 520)


def learner_step_matches_sampler(cfg, params, devices, prompt_lens, max_new_tokens: int) -> dict:
    """train.grpo's learner step itself (fsdp.sharded_value_and_grad of grpo_loss, weights
    gathered as the policy's dtype, as train.grpo builds it) on a mesh of `devices`, against the
    sampler (rlkjax.generate on the default device): the step's own logp_new must have the
    sampler's bits on every completion token, so its ratio is exactly 1, and its gradient (random
    non-zero advantages) must be finite and non-zero. Returns what was compared."""
    rng = np.random.default_rng(len(prompt_lens))
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in prompt_lens]
    comps = rlkjax.generate(params, cfg, prompts, max_tokens=max_new_tokens, seeds=list(range(len(prompts))))
    samples = [
        as_sample(p, c.tokens, c.logprobs, float(a))
        for p, c, a in zip(prompts, comps, rng.standard_normal(len(prompts)))
    ]
    batch = pad_rows(pack(samples), len(devices))
    mesh = fsdp.make_mesh(devices)
    specs = fsdp.param_specs(params, len(devices))
    objective = Objective(model.LearnerPass(cfg, "strict"), clip_eps=0.2, beta=0.0)
    grad_fn = fsdp.sharded_value_and_grad(grpo_loss, mesh, specs, dtype=cfg.dtype, objective=objective)
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
    keys = max(len(s.prompt) + len(s.tokens) for s in samples)
    return {"logprobs": int(sel.sum()), "keys": keys, "kv_splits": -(-keys // ATTENTION.kv_split), "grad_norm": norm}


def learner_step(out: Path) -> list[dict]:
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    params = rlkjax.init_params(cfg, seed=0)
    return [
        learner_step_matches_sampler(cfg, params, jax.devices()[:2], lens, max_new_tokens=16)
        for lens in (SHORT_PROMPTS, LONG_PROMPTS)
    ]


def layout_runs(out: Path) -> list[str]:
    for learner, sampler in LAYOUTS:
        run = out / f"{learner}-{sampler}"
        grpo.train(grpo.GRPOConfig(out=str(run), learner_devices=learner, sampler_devices=sampler, **LAYOUT_RUN))
    return [f"{learner}-{sampler}" for learner, sampler in LAYOUTS]


def grpo_runs(out: Path) -> dict:
    steps = {}
    for name, layout in {"fsdp": dict(learner_devices="0-7", sampler_devices="6,7"), "single": {}}.items():
        result = grpo.train(grpo.GRPOConfig(out=str(out / name), **GRPO_RUN, **layout))
        leaves = jax.tree_util.tree_leaves_with_path(result["master"])
        np.savez(out / name / "master.npz", **{jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves})
        steps[name] = len(result["history"])
    return steps


def step_temporaries(cfg, devices: int, rows: int, tokens: int, remat: str = "off") -> int:
    (result,) = compiled_memory(learner_programs(cfg, devices, rows, tokens, remat=remat, only=("step",))).values()
    return result["temporaries"]


def memory_per_layer(out: Path) -> dict:
    """WIDE's learner step at 2 and 4 layers on 4 devices, one row per device of 16 tokens."""
    return {
        f"4 {layers}": step_temporaries(dataclasses.replace(WIDE, num_layers=layers), 4, 4, 16) for layers in (2, 4)
    }


def remat_per_layer(out: Path) -> dict:
    """qwen3-tiny's learner step with --remat at 2 and 4 layers on 2 devices: 4 rows of 256 tokens."""
    cfg = ModelConfig.preset("qwen3-tiny")
    return {
        str(layers): step_temporaries(dataclasses.replace(cfg, num_layers=layers), 2, 4, 256, remat="on")
        for layers in (2, 4)
    }


def compile_8b(out: Path) -> dict:
    """Qwen3-8B's learner step and optimiser update on 8 devices, compiled from abstract inputs (nothing
    is allocated, no weights exist). Per program: every input's and output's per-device element count
    next to its global one, and XLA's memory analysis."""
    programs = learner_programs(ModelConfig.preset("qwen3-8b"), devices=8, rows=16, tokens=384, only=("step", "update"))
    result = {}
    for name in ("learner step (value and grad)", "optimiser update (one layer)"):
        lowered = programs[name]
        compiled = lowered.compile()
        result[name] = {
            "inputs": shard_sizes(lowered.args_info[0], compiled.input_shardings[0]),
            "outputs": shard_sizes(lowered.out_info, compiled.output_shardings),
            "memory": memory(compiled, lowered),
        }
    return result


PARTS = {
    "learner-step": learner_step,
    "grpo": grpo_runs,
    "layouts": layout_runs,  # after grpo: its samplers and its 1-device learner reuse grpo's programs
    "memory": memory_per_layer,
    "remat": remat_per_layer,
    "8b": compile_8b,  # last: the largest (1.3 GB while it compiles)
}


def main(out: Path, parts: list[str]) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    for name in parts:
        (out / name).mkdir(parents=True, exist_ok=True)
        try:
            result = PARTS[name](out / name)
        except Exception:
            (out / name / "error.txt").write_text(traceback.format_exc())
            print(f"{name}: failed", flush=True)
        else:
            (out / name / "result.json").write_text(json.dumps(result))
            print(f"{name}: done", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2 or not set(sys.argv[2:]) <= set(PARTS):
        raise SystemExit(f"usage: python -m tests.sharded_contract OUT [{' | '.join(PARTS)} ...] (got {sys.argv[1:]})")
    main(Path(sys.argv[1]), sys.argv[2:] or list(PARTS))
