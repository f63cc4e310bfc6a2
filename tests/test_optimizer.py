"""train/optimizer.py: AdamW applied a piece at a time, its moments on the device or in pinned host memory."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rlkjax
from tests.helpers import assert_bits_equal
from train import fsdp, grpo, optimizer

HYPER = optimizer.Hyper(learning_rate=1e-2, warmup_steps=1, decay_steps=10, max_grad_norm=1.0, weight_decay=0.1)


def _setup(moments: str):
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    params = rlkjax.init_params(cfg, seed=0, dtype=jnp.float32)
    mesh = fsdp.make_mesh(jax.devices()[:1])
    specs = fsdp.param_specs(params, 1)
    master = fsdp.put(params, mesh, specs)
    opt = optimizer.make(HYPER, mesh, specs, moments)
    return opt, master, optimizer.init(opt, master)


def _gradients(master, step: int):
    """Gradients whose norm passes the clip on some steps and not on others (scale 10^(step - 2))."""
    keys = iter(jax.random.split(jax.random.key(step), len(jax.tree.leaves(master))))
    scale = 10.0 ** (step - 2)
    return jax.tree.map(lambda w: scale * jax.random.normal(next(keys), w.shape, jnp.float32), master)


def _run(moments: str, steps: int = 3):
    opt, master, state = _setup(moments)
    norms = []
    for step in range(steps):
        master, state, norm, finite = optimizer.update(opt, _gradients(master, step), state, master)
        assert all(v.all() for v in finite.values())
        norms.append(float(norm))
    return master, state, norms


def _moments(state):
    """(mu, nu) with host moments' per-layer lists stacked back into the device layout, on the host."""
    adam = state[1][0]

    def stacked(tree):
        layers = tree["layers"]
        if isinstance(layers, list):
            layers = {k: np.stack([np.asarray(layer[k]) for layer in layers]) for k in layers[0]}
        return {**{k: np.asarray(v) for k, v in tree.items() if k != "layers"}, "layers": jax.device_get(layers)}

    return stacked(adam.mu), stacked(adam.nu)


def test_host_moments_give_the_device_moments_bits():
    """Moments streamed from pinned host memory a layer at a time give the master weights and moments the bits of
    moments kept on the device: the same jitted piece on the same values (a copy between memories is exact)."""
    device_master, device_state, device_norms = _run("device")
    host_master, host_state, host_norms = _run("host")
    assert device_norms == host_norms
    assert host_state[1][0].mu["layers"][0]["q_proj"].sharding.memory_kind == "pinned_host"
    for a, b in zip(jax.tree.leaves(jax.device_get(device_master)), jax.tree.leaves(jax.device_get(host_master))):
        assert_bits_equal(a, b, "master weights")
    for a, b in zip(jax.tree.leaves(_moments(device_state)), jax.tree.leaves(_moments(host_state))):
        assert_bits_equal(a, b, "AdamW moments")
    assert int(device_state[1][0].count) == int(host_state[1][0].count) == 3


def test_pieces_give_the_whole_tree_update_bits():
    """A piece at a time is the clip-then-AdamW of one jitted update over the whole tree, bit for bit: the
    pieces only split the elementwise work (on the CPU, where XLA contracts no multiply-add into an FMA)."""
    master, _, _ = _run("device")
    opt, reference, _ = _setup("device")
    tx = optimizer._adamw(HYPER)

    @jax.jit
    def whole(grads, state, params):
        norm = fsdp.global_norm(grads, opt.mesh, opt.specs)
        grads = jax.tree.map(lambda g: optimizer.clip(g, norm, HYPER.max_grad_norm), grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(reference)
    for step in range(3):
        reference, state = whole(_gradients(reference, step), state, reference)
    for a, b in zip(jax.tree.leaves(jax.device_get(master)), jax.tree.leaves(jax.device_get(reference))):
        assert_bits_equal(a, b, "master weights")


@pytest.mark.parametrize("moments", ["device", "host"])
def test_a_non_finite_gradient_is_named(moments):
    opt, master, state = _setup(moments)
    grads = _gradients(master, 0)
    grads["layers"]["down_proj"] = grads["layers"]["down_proj"].at[1, 0, 0].set(jnp.nan)
    _, new_state, _, finite = optimizer.update(opt, grads, state, master)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(master)[0]]
    assert [p for p, ok in zip(paths, finite["gradient"]) if not ok] == ["['layers']['down_proj']"]
    # The NaN makes the global norm NaN, and the clip spreads it to every tensor and moment (as optax's would);
    # guards.nonfinite names the gradient first.
    assert not finite["parameter"].any()
    assert finite["optimiser state"].sum() == 2  # the two step counts


@pytest.mark.slow  # three 2-step train.grpo runs (programs shared with tests/test_grpo.py's small runs)
def test_grpo_with_host_moments_has_the_device_runs_bits_and_resumes_bit_identically(tmp_path):
    """train.grpo --moments host: the same master weights as --moments device after 2 steps, and a run
    stopped after step 1 (its checkpoint holding host moments) resumes to the same bits, step 2's metrics
    row matching the straight run's."""
    small = dict(prompts_per_step=2, group_size=4, max_new_tokens=4, max_prompt_tokens=16, progress=False)
    base = grpo.GRPOConfig(steps=2, checkpoint_every=1, **small)
    device = grpo.train(dataclasses.replace(base, moments="device", out=str(tmp_path / "device")))
    host = grpo.train(dataclasses.replace(base, moments="host", out=str(tmp_path / "host")))
    grpo.train(dataclasses.replace(base, steps=1, moments="host", out=str(tmp_path / "resumed")))
    resumed = grpo.train(dataclasses.replace(base, moments="host", out=str(tmp_path / "resumed"), resume=True))
    for other in (host, resumed):
        for a, b in zip(
            jax.tree.leaves(jax.device_get(device["master"])), jax.tree.leaves(jax.device_get(other["master"]))
        ):
            assert_bits_equal(a, b, "master weights")
    timing = lambda row: {k: v for k, v in row.items() if not k.endswith(("_s", "per_s", "mfu", "per_device"))}  # noqa: E731
    assert timing(resumed["history"][-1]) == timing(device["history"][-1])
