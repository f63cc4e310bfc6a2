"""The contract across layouts, on fake CPU devices (a subprocess, since the device count is fixed
when JAX starts): train.grpo's learner step vs the sampler on 2 devices, bit for bit; GRPO with
the learner and the samplers on different, overlapping or the same devices; a GRPO run with an
8-device learner and 2 samplers against the same run on one device; the device flags' errors; and
the learner step's compiled memory per layer (XLA's analysis, nothing runs). The slow tests share one
subprocess (tests/sharded_contract.py), which runs the parts the selected tests need."""

import json
import math
import subprocess
import sys

import jax
import numpy as np
import pytest

import rlkjax
from tests.helpers import fake_devices
from tests.sharded_contract import GRPO_RUN, LAYOUTS, PARTS, WIDE
from train.fsdp import distributed_args, parse_devices, pick_devices
from train.grpo import GRPOConfig

ENV = fake_devices(8) | {"JAX_PLATFORMS": "cpu"}

# The part of tests/sharded_contract.py each slow test reads.
PART_OF_TEST = {
    "test_learner_step_has_the_samplers_bits_on_two_devices": "learner-step",
    "test_grpo_is_exact_on_any_device_layout": "layouts",
    "test_grpo_fsdp_learner_follows_the_single_device_trajectory": "grpo",
    "test_learner_step_memory_per_layer_scales_like_its_shard": "memory",
    "test_learner_step_keeps_few_activations_per_layer": "remat",
    "test_8b_learner_compiles_sharded_over_8_devices": "8b",
}


@pytest.fixture(scope="module")
def sharded(request, tmp_path_factory):
    """tests/sharded_contract.py in one subprocess on 8 fake CPU devices, for the parts that this run's
    selected tests read -> (its output directory, the finished process)."""
    selected = {
        PART_OF_TEST.get(item.originalname) for item in request.session.items if item.module is sys.modules[__name__]
    }
    parts = [part for part in PARTS if part in selected]
    out = tmp_path_factory.mktemp("sharded")
    cmd = [sys.executable, "-m", "tests.sharded_contract", str(out), *parts]
    return out, subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=3600)


def part(sharded, name: str):
    """The output directory of one part and its result; fails with the part's traceback, or the process's
    output if it died."""
    out, r = sharded
    if (out / name / "error.txt").exists():
        pytest.fail(f"tests/sharded_contract.py {name}:\n{(out / name / 'error.txt').read_text()[-4000:]}")
    assert (out / name / "result.json").exists(), f"exit status {r.returncode}: {r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return out / name, json.loads((out / name / "result.json").read_text())


# The sampler's logprobs against the FSDP learner's rescoring of them on 8, 4, 2 and 1 devices, bit for
# bit, are checked by train.grpo runs (--verify-logprobs, on by default, rescores every step and the run
# stops on a differing bit): 8 and 1 in test_grpo_fsdp_learner_follows_the_single_device_trajectory, 4 in
# test_multiprocess, 2 in test_grpo_is_exact_on_any_device_layout (the sampler on a device of its own).


@pytest.mark.slow  # traces and lowers the learner step on 2 devices at two lengths
def test_learner_step_has_the_samplers_bits_on_two_devices(sharded):
    """The CPU twin of tests/test_gpu.py's two-GPU checks (the same body, tests/sharded_contract.py
    learner_step_matches_sampler, at the tiny shape): train.grpo's learner step itself, not only the
    scoring pass, returns the sampler's logprob bits on a 2-device mesh, for short rows and for rows
    over 3 attention KV splits (the split merge in the learner's pass and in the sampler's decode)."""
    _, results = part(sharded, "learner-step")
    assert [result["kv_splits"] for result in results] == [1, 3], results


@pytest.mark.slow  # a GRPO run per layout
def test_grpo_is_exact_on_any_device_layout(sharded):
    """Every step: the learner recomputes the sampler's logprobs with 0 bits differing and the first
    update's ratio is exactly 1 (the run stops otherwise); step 2 samples with the weights pushed to
    the sampler devices after step 1 (policy version 1). Prevents a layout whose weight push or
    batch placement goes astray, e.g. a sampler left with stale weights on a device the learner
    does not hold. Layouts: tests/sharded_contract.py LAYOUTS."""
    out, _ = part(sharded, "layouts")
    for learner, sampler in LAYOUTS:
        rows = [json.loads(line) for line in (out / f"{learner}-{sampler}" / "metrics.jsonl").read_text().splitlines()]
        assert [row["policy_version"] for row in rows] == [0, 1], (learner, sampler)
        for row in rows:
            assert row["tokens_compared"] > 0 and row["tokens_bits_differ"] == 0, (learner, sampler, row)
            assert row["ratio_min"] == row["ratio_max"] == 1.0, (learner, sampler, row)


@pytest.mark.parametrize(
    "spec, match",
    [("", "expected device indices"), ("0,x", "expected device indices"), ("1-0", "empty"), ("0,0-1", "twice")],
)
def test_device_flags_reject_bad_syntax(spec, match):
    for flag in ("learner_devices", "sampler_devices"):
        with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')}=.*{match}"):
            GRPOConfig(**{flag: spec})


def test_device_flags_reject_missing_devices():
    assert parse_devices("--learner-devices", "0-2,5") == [0, 1, 2, 5]
    assert pick_devices("--sampler-devices", "all") == jax.devices()
    with pytest.raises(ValueError, match=r"--learner-devices='0,1': device 1 does not exist; 1 devices are visible"):
        pick_devices("--learner-devices", "0,1")


def test_process_flags_are_checked():
    with pytest.raises(ValueError, match="--num-processes=2 needs --coordinator"):
        GRPOConfig(num_processes=2)
    with pytest.raises(ValueError, match=r"--process-id=2 must be in \[0, --num-processes=2\)"):
        GRPOConfig(num_processes=2, process_id=2, coordinator="127.0.0.1:1234")
    with pytest.raises(ValueError, match="--rollout-url runs with one learner process"):
        GRPOConfig(num_processes=2, coordinator="127.0.0.1:1234", rollout_url="http://127.0.0.1:8000")


def test_processes_join_from_flags_or_the_environment():
    """Flags first, then the JAX_* variables, then srun / mpirun (which jax.distributed reads itself);
    a lone process joins nothing. Prevents a launcher's half-set variables from starting a one-process
    run that never meets the others."""
    flags = dict(coordinator_address="10.0.0.1:99", num_processes=4, process_id=3)
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.2:77", "JAX_NUM_PROCESSES": "8", "JAX_PROCESS_ID": "5"}
    assert distributed_args("10.0.0.1:99", 4, 3, env) == flags
    assert distributed_args(None, 1, 0, env) == dict(coordinator_address="10.0.0.2:77", num_processes=8, process_id=5)
    assert distributed_args(None, 1, 0, {}) is None
    assert distributed_args(None, 1, 0, {"SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "n[1-8]"}) == {}
    assert distributed_args(None, 1, 0, {"SLURM_NTASKS": "1", "SLURM_STEP_NODELIST": "n1"}) is None
    assert distributed_args(None, 1, 0, {"SLURM_NTASKS": "8"}) is None  # sbatch's script itself, not a task of srun
    assert distributed_args(None, 1, 0, {"OMPI_COMM_WORLD_SIZE": "2"}) == {}
    with pytest.raises(ValueError, match="JAX_COORDINATOR_ADDRESS set without JAX_NUM_PROCESSES, JAX_PROCESS_ID"):
        distributed_args(None, 1, 0, {"JAX_COORDINATOR_ADDRESS": "10.0.0.2:77"})
    with pytest.raises(ValueError, match="expected 0 <= index < count"):
        distributed_args(None, 1, 0, env | {"JAX_PROCESS_ID": "8"})


@pytest.mark.slow
def test_grpo_fsdp_learner_follows_the_single_device_trajectory(sharded):
    """The same 2-step GRPO run with an 8-device FSDP learner + 2 sampler devices and on 1 device.

    Bits where bits are promised: on both layouts every step has mismatch 0 and first-update ratio
    exactly 1 (the run would stop otherwise). The first update's learning rate is 0 (the warmup starts
    at 0), so both steps sample with the initial weights on both layouts: the same rollouts, so reward
    mean/std and the sampler's logprobs (entropy estimate) are equal exactly.

    Where they are not: FSDP sums gradients that each device rounded to bf16 over its own rows (in
    device order, train/fsdp.py), so gradients differ in their last bf16 bits (and losses in the
    summation order). Tolerances:
      - loss (at ratio 1 it is -sum(A * mask) / tokens, from identical fp32 terms): each side's fp32 sum
        of n <= 64 terms per micro-batch (at most the step's completion tokens) errs by at most n u max|A|
        (u = 2^-24; Samuelson: a group-
        normalised |A| <= sqrt(G - 1)); doubled for both sides, doubled again for the division and the
        host's sum of micro-batches: |delta| <= 4 n u sqrt(G - 1).
      - final weights = initial - lr_1 * Adam's step (the only update with a nonzero rate). Adam's step
        at t = 2 is bounded per element by sqrt(sum_i w_i^2 / v_i) ~ 1.0013 (its bias-corrected
        moment weights, Cauchy-Schwarz), so each run moved each weight by at most that * lr_1, and the
        two runs differ by at most twice that (a weight whose gradient is pure rounding noise may step
        either way). An element whose partial gradients do not cancel has a relative gradient error
        <= 2 * 2^-9 (two bf16 roundings), which moves its step by <= 2^-7 * lr_1: the median weight
        must agree that closely (measured: 99% of weights do). Slack: one fp32 ulp at 1.0, the largest
        initial weight, for the rounding of initial + step.
    """
    out, _ = part(sharded, "grpo")
    runs = {
        name: [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("fsdp", "single")
    }
    assert len(runs["fsdp"]) == len(runs["single"]) == GRPO_RUN["steps"] == 2
    # a micro-batch holds at most every completion token of the step (its budget is in padded tokens)
    group = GRPO_RUN["group_size"]
    tokens_per_micro_batch = GRPO_RUN["prompts_per_step"] * group * GRPO_RUN["max_new_tokens"]
    loss_atol = 4 * tokens_per_micro_batch * 2.0**-24 * math.sqrt(group - 1)
    for fsdp, single in zip(runs["fsdp"], runs["single"]):
        for row in (fsdp, single):
            assert (
                row["tokens_bits_differ"] == 0
                and row["tokens_compared"] > 0
                and row["ratio_min"] == row["ratio_max"] == 1.0
            ), row
        for key in ("reward_mean", "reward_std", "entropy_estimate", "tokens_compared"):
            assert fsdp[key] == single[key], (fsdp["step"], key, fsdp[key], single[key])
        assert abs(fsdp["loss"] - single["loss"]) <= loss_atol, (fsdp["step"], fsdp["loss"], single["loss"], loss_atol)

    optimiser = GRPOConfig().optimiser
    lr_1 = optimiser.learning_rate / optimiser.warmup_steps  # linear warmup from 0: the second update's rate
    b1, b2 = 0.9, 0.999  # optax.adamw's defaults
    m_weights = np.array([(1 - b1) * b1, 1 - b1]) / (1 - b1**2)  # bias-corrected first moment at t = 2
    v_weights = np.array([(1 - b2) * b2, 1 - b2]) / (1 - b2**2)
    max_step = lr_1 * math.sqrt(np.sum(m_weights**2 / v_weights))
    ulp = 2.0**-23
    params = rlkjax.init_params(rlkjax.ModelConfig.preset("qwen3-tiny"), seed=0)
    initial = {
        jax.tree_util.keystr(path): np.asarray(x, np.float32) for path, x in jax.tree_util.tree_leaves_with_path(params)
    }
    fsdp, single = np.load(out / "fsdp" / "master.npz"), np.load(out / "single" / "master.npz")
    assert sorted(fsdp.files) == sorted(single.files) == sorted(initial)
    delta = np.concatenate([(fsdp[k] - single[k]).ravel() for k in single.files])
    for run in (fsdp, single):
        moved = np.concatenate([(run[k] - initial[k]).ravel() for k in single.files])
        assert np.abs(moved).max() <= max_step + ulp, (np.abs(moved).max(), max_step)
        assert np.count_nonzero(moved) > 0.99 * moved.size  # it did train
    assert np.abs(delta).max() <= 2 * max_step + ulp, np.abs(delta).max()
    assert np.median(np.abs(delta)) <= 2.0**-7 * lr_1, np.median(np.abs(delta))


@pytest.mark.slow  # two compilations of the learner step (tests/sharded_contract.py memory_per_layer)
def test_learner_step_memory_per_layer_scales_like_its_shard(sharded):
    """Each added layer costs a learner device its fp32 gradient shard (4 bytes x layer params / N)
    and a little more (activations), never a full copy of the layer: prevents the FSDP learner from
    gathering, or reduce-scattering the gradients of, the whole model at once (at Qwen3-8B on 2 GPUs
    that held 45.9 GiB of full-model buffers and did not fit). On 4 devices the bound, 1.5 x the
    layer's parameter count in bytes, is below a whole fp32 gradient (4x) and a whole bf16 copy (2x)."""
    _, temporaries = part(sharded, "memory")
    layer_params = sum(math.prod(shape) for shape in rlkjax.core.model.layer_shapes(WIDE).values())
    per_layer = (temporaries["4 4"] - temporaries["4 2"]) / 2
    assert per_layer < 4 * layer_params / 4 + layer_params / 2, (per_layer, layer_params)


@pytest.mark.slow  # two compilations of the learner step (tests/sharded_contract.py remat_per_layer)
def test_learner_step_keeps_few_activations_per_layer(sharded):
    """With --remat (model.forward's remat) each added layer costs the FSDP learner step (2 devices, 2 of
    the 4 rows each) its fp32 gradient shard and the bf16 activations its backward cannot recompute
    cheaply: the layer's input and the attention's q, k, v and output. The norms' outputs, the q/k
    projections before their norms and the MLP's gate, up and swiglu arrays are recomputed, not stacked
    by the layer scan (at Qwen3-4B, 4 x 1024 tokens, those were 308 of 428 MiB per layer and the step
    did not fit one H200). The probe can tell: without the remat the same step takes 1,098,368 bytes per
    layer, over the bound of 467,264, against 316,032 with it (measured once; not compiled on each run:
    two more compilations that would check the probe, not the code). Two devices: one device takes whole
    weights, no scan (train/fsdp.py gather), and XLA:CPU's analysis of that pass counts interpret mode's
    copies."""
    _, temporaries = part(sharded, "remat")
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    n, d, dh = 4 * 256 // 2, cfg.hidden_size, cfg.head_dim  # this device's tokens
    kept = 2 * n * (d + (cfg.num_heads + 2 * cfg.num_kv_heads) * dh + cfg.num_heads * dh)  # x; q, k, v; attn
    gradient = 4 * sum(math.prod(shape) for shape in rlkjax.core.model.layer_shapes(cfg).values()) / 2  # its shard
    mlp = 2 * n * cfg.intermediate_size  # one bf16 [tokens, intermediate] array: the slack allowed
    per_layer = (temporaries["4"] - temporaries["2"]) / 2
    assert per_layer <= kept + gradient + mlp, (per_layer, kept, gradient)


@pytest.mark.slow  # 2.5 min on 2 idle cores (5.5 loaded), 1.3 GB: the layer scan compiles its body once
def test_8b_learner_compiles_sharded_over_8_devices(sharded):
    """The Qwen3-8B learner step (all 36 layers; train.grpo's default micro-batch of 16 rows of 384
    tokens: 128 prompt + 256 new) and the AdamW update's step of one layer compile for 8 devices with the
    parameters, their gradients and both AdamW moments split 8 ways, in the inputs and in what XLA chose
    for the outputs (the update's outputs are not pinned: a replicated master or moment costs each device
    8x its share, and would first show on 8 GPUs). Interpret mode's compile on CPU; the shardings and
    buffer sizes are the program's, not a GPU measurement."""
    _, programs = part(sharded, "8b")
    shapes = jax.tree.leaves(jax.eval_shape(lambda: rlkjax.init_params(rlkjax.ModelConfig.preset("qwen3-8b"))))
    n, p = len(shapes), sum(x.size for x in shapes)  # parameter tensors, parameters (8.2e9)
    step, update = programs["learner step (value and grad)"], programs["optimiser update (one layer)"]
    layer_shapes = rlkjax.core.model.layer_shapes(rlkjax.ModelConfig.preset("qwen3-8b"))
    per_layer, leaves = sum(math.prod(s) for s in layer_shapes.values()), len(layer_shapes)
    split = {
        "step's master weights": step["inputs"][:n],
        "step's gradients in": step["inputs"][-n:],
        "step's gradients out": step["outputs"][-n:],
        # (layers' master, layers' gradients, the layer's two moments, index, counts, norm) -> (layers' master,
        # the layer's two moments, counts, finiteness): all layer-shaped but the scalars
        "update's inputs": [s for s in update["inputs"] if s[0] > 1],
        "update's outputs": [s for s in update["outputs"] if s[0] > 1],
    }
    assert len(split["update's inputs"]) == len(split["update's outputs"]) + leaves == 4 * leaves
    for what, sizes in split.items():
        whole = [size for size, shard, _ in sizes if shard * 8 != size]
        assert not whole, f"{what}: {len(whole)} tensors not split 8 ways (sizes {whole[:5]})"
    # The buffers XLA assigned agree: fp32 master + gradients (+ the batch and RoPE tables, < 64 MiB) for
    # the step; the layers' master and gradients and one layer's two moments for the update's layer step.
    assert 8 * p / 8 <= step["memory"]["arguments"] < 8 * p / 8 + 2**26, step["memory"]
    layers = 36 * per_layer
    assert (8 * layers + 8 * per_layer) / 8 <= update["memory"]["arguments"] < (8 * layers + 8 * per_layer) / 8 + 2**10
