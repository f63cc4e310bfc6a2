"""The learner's objective, imported by the learner (train/learner.py) and by train.grpo's loop: the policy's
logprobs from the fp32 master weights, and the token-level PPO-clip surrogate (+ k3 KL) GRPO minimises.
"""

import dataclasses

import jax
import jax.numpy as jnp

from rlkjax.core import model
from rlkjax.core.model import LearnerPass
from train.batch import Batch, LossStats


def to_policy(master, cfg):
    """fp32 master weights -> the policy (cfg.dtype): what the sampler runs and the learner scores with."""
    return jax.tree.map(lambda w: w.astype(cfg.dtype), master)


@dataclasses.dataclass(frozen=True)
class Objective:
    """What grpo_loss minimises, one hashable value (a jit static argument): the policy's pass and the
    clipped surrogate's settings."""

    policy: LearnerPass  # the model, numerics and remat of the policy's logprobs
    clip_eps: float = 0.2  # the ratio is clipped to [1 - clip_eps, 1 + clip_eps]
    beta: float = 0.0  # weight of the k3 KL to the reference policy; 0: none (ref_logp is not read)


def policy_logprobs(master, seqs: model.Sequences, rope, setting: LearnerPass, layers=None):
    """logp [B, T-1] of the policy (model.sequence_logprobs at `setting`, whose cfg.dtype the master
    weights are cast to). layers: where the layers' weights come from (model.LayerWeights), None:
    master["layers"], cast to the policy; the FSDP learner passes train/fsdp.py's `Gathered`, which gathers
    them as the policy's dtype (half the bytes of fp32 moved and held), and master's other weights only.
    seqs.columns: the Batch's (the completion's columns): the log-softmax runs there only and every other
    column holds 0 (model.completion_logprobs); None scores every column."""
    policy = to_policy(master if layers is None else {k: w for k, w in master.items() if k != "layers"}, setting.cfg)
    return model.sequence_logprobs(policy, seqs, rope, setting, layers)


def grpo_loss(master, batch: Batch, ref_logp, rope, total_tokens, objective: Objective, layers=None):
    """Token-level PPO-clip (+ k3 KL) summed over this micro-batch, divided by the whole batch's
    token count, so summing micro-batch gradients gives the full-batch gradient.
    Returns (loss, (LossStats, logp_new [B, T-1])); logp_new lets the first update check the contract."""
    seqs = model.Sequences(batch.tokens, batch.positions, batch.temps, batch.columns)
    logp = policy_logprobs(master, seqs, rope, objective.policy, layers)
    clip_eps, beta = objective.clip_eps, objective.beta
    mask, adv = batch.mask, batch.adv[:, None]
    ratio = jnp.exp(logp - batch.logp_old)
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps) * adv) * batch.tis
    per_token = -surrogate
    if beta:
        per_token = per_token + beta * (jnp.exp(ref_logp - logp) - (ref_logp - logp) - 1)
    loss = jnp.sum(per_token * mask) / total_tokens
    stats = LossStats(
        ratio_min=jnp.min(jnp.where(mask > 0, ratio, jnp.inf)),
        ratio_max=jnp.max(jnp.where(mask > 0, ratio, -jnp.inf)),
        ratio_sum=jnp.sum(ratio * mask),
        clipped=jnp.sum((jnp.abs(ratio - 1) > clip_eps) & (mask > 0)),
    )
    return loss, (stats, logp)
