"""train.grpo's learner on its mesh: the jitted gradient, scoring and optimiser functions, built once per run
(`build_learner`), and what a step does with them: score a batch (`score`), check the sampler's logprobs
against the learner's (`verify`), and the updates (`learn`: gradients summed over micro-batches, the first
update's contract check, AdamW, the non-finite check). The loss is train/loss.py's `grpo_loss`.
"""

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rlkjax.core import lora, model
from rlkjax.core.mismatch import mismatch_stats
from train import fsdp, optimizer
from train.batch import Batch, micro_batches, plan_micro_batches, reduce_stats, unpermute
from train.guards import (
    NonFiniteError,
    contract_violation,
    enforce,
    first_update_violation,
    nonfinite,
)
from train.loss import Objective, grpo_loss, policy_logprobs, to_policy

if TYPE_CHECKING:
    from train.config import GRPOConfig


class Learner(NamedTuple):
    """The learner's mesh and its jitted functions: gradients of grpo_loss (grad_fn, summed over micro-batches
    into its last argument), scoring (score_fn, policy_logprobs) and the optimiser step (update,
    train/optimizer.py's: (grads, state, master) -> (master, state, gradient norm, finiteness)). frozen: with
    LoRA, (the frozen base params on the mesh,), every grad_fn and score_fn call's last argument; else ()."""

    devices: list
    mesh: jax.sharding.Mesh
    rope: tuple
    grad_fn: Callable
    score_fn: Callable
    update: Callable
    frozen: tuple = ()

    def on_mesh(self, batch: Batch, budget: int):
        """batch's micro-batches of at most `budget` padded tokens per device (train/batch.py
        plan_micro_batches), on the mesh (each process supplies its own devices' rows of the same host batch)."""
        for _, mb in micro_batches(batch, budget, len(self.devices)):
            yield fsdp.put(mb, self.mesh, fsdp.BATCH_SPECS)

    def unpermute(self, batch: Batch, budget: int, parts) -> np.ndarray:
        """Per-micro-batch logprobs (on the mesh, in on_mesh's order) -> [B, T-1] on the host, in batch's rows."""
        plan = plan_micro_batches(batch, budget, len(self.devices))
        return unpermute([fsdp.to_host(x) for x in parts], plan, *batch.logp_old.shape)


def build_learner(config: "GRPOConfig", cfg, params, devices, moments="device", frozen=None):
    """-> (Learner, fp32 master weights sharded over `devices`, their optimiser state). moments: where AdamW's
    moments live (train/optimizer.py). frozen (LoRA, train/adapters.py): the base params, put on the mesh in
    their own dtype and never trained; params are then the adapters. config's --remat and --micro-batch-tokens are
    settled (train.grpo's plan_memory chooses them where they are auto)."""
    unsettled = [f"--{n.replace('_', '-')}" for n in ("remat", "micro_batch_tokens") if getattr(config, n) == "auto"]
    if unsettled:
        raise ValueError(f"{' and '.join(unsettled)} auto: the memory plan chooses them (train.grpo plan_memory)")
    mesh = fsdp.make_mesh(devices)
    specs = fsdp.param_specs(params, len(devices))
    master = fsdp.put(params, mesh, specs, dtype=jnp.float32)
    rope = fsdp.put(model.rope_tables(cfg), mesh, fsdp.REPLICATED)
    layout = (mesh, *_hashable(specs))
    frozen_specs = None if frozen is None else fsdp.param_specs(frozen, len(devices))
    fixed = () if frozen is None else (fsdp.put(frozen, mesh, frozen_specs),)
    frozen_layout = None if frozen is None else _hashable(frozen_specs)
    grad_fn = _grad_fn(
        *layout, cfg, config.runtime.numerics, config.clip_eps, config.beta, config.remat, frozen_layout=frozen_layout
    )
    score_fn = _score_fn(*layout, cfg, config.runtime.numerics, frozen_layout=frozen_layout)
    opt = optimizer.make(config.optimiser.hyper(config.steps * config.updates_per_batch), mesh, specs, moments)
    update = functools.partial(optimizer.update, opt)
    return Learner(devices, mesh, rope, grad_fn, score_fn, update, fixed), master, optimizer.init(opt, master)


def policy(learner: Learner, master, cfg):
    """The weights the sampler runs: the master cast to the policy's dtype (train/loss.py to_policy), beside the
    frozen base with LoRA."""
    cast = to_policy(master, cfg)
    return lora.merge(learner.frozen[0], cast) if learner.frozen else cast


# The learner's jitted functions are built once per process for each key, not once per run, so a process that
# trains again (a notebook, a sweep, a resumed run, the tests) does not trace the whole model again. Each key is
# everything its programs close over (functions, mesh, specs, model, numerics, hyperparameters); the arguments'
# shapes and dtypes are jit's own key.
def _hashable(specs) -> tuple:
    """The specs pytree as (leaves, treedef), hashable (a dict is not); _specs undoes it."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    return tuple(leaves), treedef


def _specs(leaves, treedef):
    return jax.tree.unflatten(treedef, leaves)


@functools.lru_cache(maxsize=4)
def _grad_fn(mesh, spec_leaves, spec_tree, cfg, numerics, clip_eps, beta, remat, *, frozen_layout=None):
    # The weights are gathered as the policy's dtype (policy_logprobs' own cast is then a no-op; the layers'
    # reach model.forward as fsdp.Gathered): the same bits as casting after the gather, with half the bytes
    # moved and held.
    specs = _specs(spec_leaves, spec_tree)
    frozen = dict(frozen_specs=_specs(*frozen_layout)) if frozen_layout else {}
    objective = Objective(model.LearnerPass(cfg, numerics, remat), clip_eps, beta)
    return fsdp.sharded_value_and_grad(grpo_loss, mesh, specs, dtype=cfg.dtype, **frozen, objective=objective)


@functools.lru_cache(maxsize=4)
def _score_fn(mesh, spec_leaves, spec_tree, cfg, numerics, *, frozen_layout=None):
    specs = _specs(spec_leaves, spec_tree)
    frozen = dict(frozen_specs=_specs(*frozen_layout)) if frozen_layout else {}
    setting = model.LearnerPass(cfg, numerics)
    return fsdp.sharded_logprobs(policy_logprobs, mesh, specs, dtype=cfg.dtype, **frozen, setting=setting)


def score(learner: Learner, weights, batch: Batch, budget: int) -> np.ndarray:
    """[B, T-1] logprobs of `batch` under `weights` (master or the KL reference), on the host, in micro-batches
    of at most `budget` tokens per device. Every micro-batch is dispatched before any is read back: the device
    never waits on the host."""
    scored = [
        learner.score_fn(weights, mb.tokens, mb.positions, mb.temps, learner.rope, mb.columns, *learner.frozen)
        for mb in learner.on_mesh(batch, budget)
    ]
    return learner.unpermute(batch, budget, scored)


def verify(step: int, learner: Learner, master, batch: Batch, config: "GRPOConfig") -> tuple[dict, Batch]:
    """The learner recomputes logp_old: the mismatch row, the contract enforced in strict numerics (before
    any update, so a broken contract never trains), and with --tis-cap the batch's truncated IS weights."""
    learner_old = score(learner, master, batch, config.micro_batch_tokens)
    sel = batch.mask > 0
    row = mismatch_stats(batch.logp_old[sel], learner_old[sel])
    if config.runtime.numerics == "strict":
        problem = contract_violation(step, "sampler vs learner logprobs", batch, learner_old, config.group_size)
        enforce(problem, config.on_mismatch)
    if config.tis_cap:
        tis = np.minimum(np.exp(learner_old - batch.logp_old), config.tis_cap).astype(np.float32) * batch.mask
        batch = batch._replace(tis=tis)
    return row, batch


def gradients(learner: Learner, master, ref, batch: Batch, total_tokens, config: "GRPOConfig"):
    """One update's gradient, summed over micro-batches -> (grads, [loss], [LossStats], [logp_new]) on the
    device; the caller reads them back after the last micro-batch is dispatched (reading each one made the
    device wait for the host to put the next micro-batch on the mesh)."""
    # Zeros to start the sum: 0 + g is g exactly (a -0.0 becomes +0.0, the same to AdamW).
    grads, losses, stats, logp_new = jax.tree.map(jnp.zeros_like, master), [], [], []
    for mb in learner.on_mesh(batch, config.micro_batch_tokens):
        ref_logp = (
            learner.score_fn(ref, mb.tokens, mb.positions, mb.temps, learner.rope, mb.columns, *learner.frozen)
            if config.beta
            else fsdp.put(np.zeros(mb.logp_old.shape, np.float32), learner.mesh, fsdp.ROWS)
        )
        (loss, (st, logp)), grads = learner.grad_fn(
            master, mb, ref_logp, learner.rope, total_tokens, grads, *learner.frozen
        )
        losses.append(loss)
        stats.append(st)
        logp_new.append(logp)
    return grads, losses, stats, logp_new


def learn(step: int, learner: Learner, state: dict, batch: Batch, config: "GRPOConfig", checkpoints, phases=None):
    """--updates-per-batch optimiser steps on `batch`. state: {master, opt_state, ref} -> (the updated state,
    the row's loss, ratio and gradient fields, from the first update, and the seconds spent computing gradients
    (learn_s) and in the optimiser's update, host transfers included (update_s)). The first update's logp_new
    must have logp_old's bits (strict numerics), and a non-finite loss, gradient or state stops the run before
    any weight sync, metrics row or checkpoint is written from it. phases: a train/memory.py PhasePeaks."""
    master, opt_state = state["master"], state["opt_state"]
    total_tokens = float(batch.mask.sum())
    tokens_on_mesh = fsdp.put(np.float32(total_tokens), learner.mesh, fsdp.REPLICATED)
    mark = phases.phase if phases else (lambda name: None)
    row = {"learn_s": 0.0, "update_s": 0.0}
    for u in range(config.updates_per_batch):
        start = time.perf_counter()
        mark("learner step")
        grads, losses, stats, logp_new = gradients(learner, master, state["ref"], batch, tokens_on_mesh, config)
        losses = [float(x) for x in fsdp.to_host(losses)]
        stats = fsdp.to_host(stats)
        if u == 0:
            st = reduce_stats(stats)
            row |= {
                "ratio_min": float(st.ratio_min),
                "ratio_max": float(st.ratio_max),
                "ratio_mean": float(st.ratio_sum / total_tokens),
                "clip_fraction": float(st.clipped / total_tokens),
                "loss": sum(losses),
            }
            if config.runtime.numerics == "strict":  # before the update is applied
                logp_new = learner.unpermute(batch, config.micro_batch_tokens, logp_new)
                enforce(first_update_violation(step, batch, logp_new, st, config.group_size), config.on_mismatch)
                row["first_update_tokens_compared"] = int(total_tokens)  # every completion token's bits
        learned = time.perf_counter()
        mark("optimiser update")
        new_master, new_opt_state, grad_norm, finite = learner.update(grads, opt_state, master)
        trees = {"gradient": grads, "parameter": new_master, "optimiser state": new_opt_state}
        problem = nonfinite(step, sum(losses), float(fsdp.to_host(grad_norm)), fsdp.to_host(finite), trees)
        if problem:
            good = checkpoints.latest()
            raise NonFiniteError(
                f"{problem} (update {u + 1} of {config.updates_per_batch}); stopped before any "
                "checkpoint, weight sync or final_hf from this state; the last good checkpoint is "
                + (f"step {good} in {checkpoints.directory}" if good else "none (none was written yet)")
            )
        master, opt_state = new_master, new_opt_state
        del grads, trees  # freed now, not when the next update's zeros replace them
        if u == 0:
            row["grad_norm"] = float(fsdp.to_host(grad_norm))
        row["learn_s"] += learned - start
        row["update_s"] += time.perf_counter() - learned
    return {**state, "master": master, "opt_state": opt_state}, row
