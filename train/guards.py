"""What stops a run rather than let it train on something wrong: a broken numerics contract (the learner's
logprob bits differ from the sampler's), a non-finite reward, loss, gradient, parameter or optimiser state
(a prompt too long for the engine is train/episodes.py's to refuse, before step 1). Each check returns or raises
a message that names the step and the place (sequence and token, tensor, example), so the first bad value is
found, not guessed.
"""

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from train.batch import Batch, LossStats
from train.checkpoints import tensor_paths

log = logging.getLogger("train.grpo")


# ----- the contract, enforced -----
class ContractError(RuntimeError):
    """Strict numerics promise the learner the sampler's logprob bits, and they differ."""


def _float(x) -> str:
    return f"{float(x)!r} (0x{int(np.float32(x).view(np.uint32)):08x})"


def contract_violation(step: int, what: str, batch: Batch, learner: np.ndarray, group_size: int) -> str | None:
    """None when `learner` [B, T-1] has logp_old's bits on every completion token; otherwise a
    message naming the step, the sequence and the first differing token."""
    differ = (batch.logp_old.view(np.uint32) != np.asarray(learner, np.float32).view(np.uint32)) & (batch.mask > 0)
    if not differ.any():
        return None
    row, col = (int(i) for i in np.argwhere(differ)[0])  # the first in batch order, then position
    return (
        f"step {step}: {what}: {int(differ.sum())} of {int(batch.mask.sum())} completion tokens differ in their bits; "
        f"first in sequence {row} of the batch (prompt {row // group_size}, sample {row % group_size}), "
        f"token position {col + 1} (id {int(batch.tokens[row, col + 1])}): "
        f"sampler {_float(batch.logp_old[row, col])}, learner {_float(learner[row, col])}"
    )


def first_update_violation(
    step: int, batch: Batch, logp_new: np.ndarray, stats: LossStats, group_size: int
) -> str | None:
    """The first update scores at the weights that sampled the batch, so its logp_new must have
    logp_old's bits and every ratio must be exactly 1 (checked on the stats too: NaN has equal bits)."""
    problem = contract_violation(step, "first update's logp_new vs logp_old", batch, logp_new, group_size)
    if problem is None and not stats.ratio_min == stats.ratio_max == 1.0:
        problem = (
            f"step {step}: first update's ratio in [{float(stats.ratio_min)!r}, {float(stats.ratio_max)!r}], "
            "not exactly 1"
        )
    return problem


def enforce(problem: str | None, on_mismatch: str) -> None:
    if problem is None:
        return
    if on_mismatch == "error":
        raise ContractError(problem + " (strict numerics; --on-mismatch warn keeps training to investigate)")
    log.warning("strict numerics contract broken: %s", problem)


# ----- non-finite values stop the run -----
class NonFiniteError(FloatingPointError):
    """A loss, gradient, parameter or optimiser-state value became NaN or infinite."""


def finite_leaves(tree) -> jax.Array:
    """[leaves] bool, inside the caller's jit: one fused all(isfinite) reduction per tensor."""
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)])


def nonfinite(step: int, loss: float, grad_norm: float, finite: dict, trees: dict) -> str | None:
    """None when all is finite; otherwise what became non-finite first, in the order computed: the
    loss, the gradients (a tensor, or their norm overflowing), the updated parameters, the optimiser
    state. `finite` holds finite_leaves of each tree in `trees`, by the same names."""
    if not math.isfinite(loss):
        return f"step {step}: the loss is {loss!r}"
    for what, tree in trees.items():
        bad = np.flatnonzero(~np.asarray(finite[what]))
        if bad.size:
            return (
                f"step {step}: {what} {tensor_paths(tree)[bad[0]]} holds non-finite values "
                f"({bad.size} of {len(finite[what])} {what} tensors do)"
            )
        if what == "gradient" and not math.isfinite(grad_norm):
            return (
                f"step {step}: the gradient norm is {grad_norm!r} "
                "(every gradient tensor is finite: the norm overflowed)"
            )
    return None


def check_rewards(step: int, rewards: np.ndarray, prompts: list[str]) -> None:
    """rewards [P, G]: a user reward's NaN would reach the loss as every token's advantage."""
    if np.isfinite(rewards).all():
        return
    prompt, sample = (int(i) for i in np.argwhere(~np.isfinite(rewards))[0])
    raise NonFiniteError(
        f"step {step}: the reward of prompt {prompt}, sample {sample} is "
        f"{float(rewards[prompt, sample])!r} ({prompts[prompt]!r})"
    )
