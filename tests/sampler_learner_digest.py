"""`python -m tests.sampler_learner_digest`: a small generate, its score and a GRPO learner gradient on
qwen3-tiny, checked against each other bit for bit (score == generate == the learner's logp_new),
then printed as one SHA-256 of every array's bytes, so that processes started with different
XLA_FLAGS can be compared bit for bit (tests/test_cpu_opt_level.py)."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

import rlkjax
from rlkjax.core import model
from tests.helpers import assert_bits_equal
from train.batch import Batch
from train.loss import Objective, grpo_loss

PROMPTS = ([5, 17, 33, 2, 9], [40, 41, 42])
TEMPERATURES = [0.7, 1.3]


def digest() -> str:
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    params = rlkjax.init_params(cfg, seed=0)
    comps = rlkjax.generate(params, cfg, PROMPTS, max_tokens=4, temperature=TEMPERATURES, seeds=[1, 2])
    seqs = [p + c.tokens for p, c in zip(PROMPTS, comps)]
    scored = rlkjax.score(params, cfg, seqs, [len(p) for p in PROMPTS], temperature=TEMPERATURES)

    b, t = len(seqs), max(map(len, seqs))
    tokens, positions = np.zeros((b, t), np.int32), np.full((b, t), -1, np.int32)
    mask = np.zeros((b, t - 1), np.float32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)], positions[i, : len(s)] = s, np.arange(len(s))
        mask[i, len(PROMPTS[i]) - 1 : len(s) - 1] = 1  # logprob column j is token j + 1's
    logp_old = np.zeros_like(mask)
    logp_old[mask > 0] = np.concatenate([c.logprobs for c in comps])
    adv, temps = np.array([1.0, -1.0], np.float32), np.array(TEMPERATURES, np.float32)
    batch = Batch(tokens, positions, logp_old, mask, adv, temps, np.ones_like(mask))
    master = jax.tree.map(lambda w: w.astype(jnp.float32), params)
    step = jax.jit(jax.value_and_grad(grpo_loss, has_aux=True), static_argnums=5)
    rope, ref = model.rope_tables(cfg), jnp.zeros_like(mask)
    objective = Objective(model.LearnerPass(cfg, "strict"), clip_eps=0.2, beta=0.0)
    (loss, (_, logp)), grads = step(master, batch, ref, rope, jnp.float32(mask.sum()), objective)

    for i, (c, s) in enumerate(zip(comps, scored)):
        assert_bits_equal(s, c.logprobs, f"row {i}: score vs generate")
    assert_bits_equal(np.asarray(logp)[mask > 0], logp_old[mask > 0], "the learner's logp_new vs generate")
    arrays = [c.logprobs for c in comps] + list(scored) + [loss, logp, *jax.tree.leaves(grads)]
    assert all(np.all(np.isfinite(a)) for a in arrays)
    h = hashlib.sha256(repr([c.tokens for c in comps]).encode())
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    print(digest())
