"""GRPO learner: the loss and advantages on hand-computed examples, the typed batch's padding,
micro-batch invariance of the learner's logprobs, the contract enforced (a corrupted logprob stops the
run, naming step, sequence and token), a subprocess smoke run, resume and same-seed bit identity, the
remote-server mode, and clear errors for bad flags."""

import dataclasses
import json
import logging
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tyro
from jax.sharding import PartitionSpec as P

import rlkjax
import train.loss
from rlkjax.core import model
from rlkjax.entry_config import ModelSource, Runtime
from rlkjax.rl.tasks import ArithmeticTask, Example, GSM8KTask, LowercaseTask
from rlkjax.text.tokenizer import ByteTokenizer
from tests.helpers import EOS, assert_bits_equal, eos_model
from tests.server_process import ADMIN, start_server
from train import fsdp, grpo, guards, metrics, rollout
from train.batch import (
    PAD,
    Batch,
    LossStats,
    as_sample,
    micro_batches,
    pack,
    pad_rows,
    padded_length,
    reduce_stats,
    unpermute,
)
from train.grpo import group_advantages
from train.loss import Objective, grpo_loss, policy_logprobs

SMALL = dict(prompts_per_step=2, group_size=4, max_new_tokens=4, max_prompt_tokens=16, progress=False)


def test_group_advantages_by_hand():
    # group 1: rewards 1, 0, 0, 1 -> mean 0.5, std 0.5 -> +1, -1, -1, +1; Dr. GRPO: +0.5, -0.5, ...
    # group 2: all equal -> zero advantage whatever the scaling
    r = np.array([[1.0, 0.0, 0.0, 1.0], [0.3, 0.3, 0.3, 0.3]])
    np.testing.assert_allclose(group_advantages(r, scale=True)[0], [1, -1, -1, 1], rtol=1e-5)
    np.testing.assert_allclose(group_advantages(r, scale=False)[0], [0.5, -0.5, -0.5, 0.5])
    assert np.all(group_advantages(r)[1] == 0)


def test_loss_by_hand(tiny, monkeypatch):
    """Two completion tokens with logp_new - logp_old = log 1.5 and log 0.5, advantages +1 and -1,
    eps 0.2: terms min(1.5*1, 1.2*1) = 1.2 and min(0.5*-1, 0.8*-1) = -0.8; loss = -(1.2 - 0.8) / 2 = -0.2.
    Both ratios are outside [0.8, 1.2]: clip fraction 1."""
    cfg, _ = tiny
    logp_new = jnp.array([[0.0, -1.0, -2.0]])
    monkeypatch.setattr(train.loss, "policy_logprobs", lambda *a: jnp.concatenate([logp_new, logp_new]))
    batch = Batch(
        tokens=None,
        positions=None,
        temps=None,
        logp_old=jnp.array([[0.0, -1.0 - np.log(1.5), -2.0], [0.0, -1.0, -2.0 - np.log(0.5)]]),
        mask=jnp.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]),
        adv=jnp.array([1.0, -1.0]),
        tis=jnp.ones((2, 3)),
    )
    loss, (stats, _) = grpo_loss(None, batch, None, None, 2.0, Objective(model.LearnerPass(cfg), 0.2, 0.0))
    np.testing.assert_allclose(float(loss), -0.2, rtol=1e-6)
    assert float(stats.clipped) == 2
    np.testing.assert_allclose([float(stats.ratio_min), float(stats.ratio_max)], [0.5, 1.5], rtol=1e-6)
    # k3 KL: ref - new = log 2 on both tokens -> exp(log 2) - log 2 - 1 = 1 - log 2 per token, beta 0.5
    loss_kl, _ = grpo_loss(None, batch, logp_new + np.log(2.0), None, 2.0, Objective(model.LearnerPass(cfg), 0.2, 0.5))
    np.testing.assert_allclose(float(loss_kl), -0.2 + 0.5 * (1 - np.log(2.0)), rtol=1e-6)


def test_batch_padding_and_stat_reductions():
    """pack: T is a power of two of at least a page up to 128 tokens, then a multiple of 128 (a short
    prompt + 512 new tokens trains 640-token rows, not 1,024), logp column t scores token t + 1. Padding
    rows carry the PAD values (positions -1, temperature 1, the rest 0). Stats combine by their declared
    reduction: min of mins, max of maxes, sums added."""
    samples = [as_sample([5, 6, 7], [8, 9], np.float32([-0.5, -1.5]), adv=2.0, temperature=0.7)]
    batch = pack(samples)
    assert batch.tokens.shape == (1, 16) and batch.logp_old.shape == (1, 15)
    assert batch.tokens[0, :6].tolist() == [5, 6, 7, 8, 9, 0] and batch.positions[0, :6].tolist() == [0, 1, 2, 3, 4, -1]
    assert batch.logp_old[0, :5].tolist() == [0, 0, -0.5, -1.5, 0] and batch.mask[0, :5].tolist() == [0, 0, 1, 1, 0]
    lengths = (1, 17, 100, 128, 129, 600, 1024, 1025)
    assert [padded_length(n) for n in lengths] == [16, 32, 128, 128, 160, 608, 1024, 1056]
    padded = pad_rows(batch, 4)
    for field, fill in zip(Batch._fields, PAD):
        values = getattr(padded, field)
        assert len(values) == 4 and np.array_equal(values[:1], getattr(batch, field)) and np.all(values[1:] == fill), (
            field
        )
    assert pad_rows(padded, 4) is padded
    a = LossStats(ratio_min=np.float32(0.9), ratio_max=np.float32(1.1), ratio_sum=np.float32(3.0), clipped=np.int32(1))
    b = LossStats(ratio_min=np.float32(0.8), ratio_max=np.float32(1.0), ratio_sum=np.float32(2.0), clipped=np.int32(2))
    assert reduce_stats([a, b]) == LossStats(np.float32(0.8), np.float32(1.1), np.float32(5.0), 3)


@pytest.mark.slow
def test_learner_logprobs_do_not_depend_on_micro_batch(tiny):
    """Every completion token's logprob (the positions the loss reads: mask) has the same bits whether the rows
    run as one batch or packed into micro-batches of 16 or 64 tokens, sorted and cut to their own lengths.
    Positions past a row's end are padding, computed but never read, and are not compared."""
    cfg, params = tiny
    master = jax.tree.map(lambda w: w.astype(jnp.float32), params)
    rng = np.random.default_rng(0)
    samples = [
        as_sample(
            rng.integers(0, 256, int(rng.integers(2, 20))).tolist(), rng.integers(0, 256, 6).tolist(), np.zeros(6)
        )
        for _ in range(6)
    ]
    batch = pack(samples)
    rope = model.rope_tables(cfg)
    score_fn = jax.jit(policy_logprobs, static_argnames="setting")
    strict = model.LearnerPass(cfg, "strict")

    def score(mb):
        return np.asarray(score_fn(master, model.Sequences(mb.tokens, mb.positions, mb.temps), rope, strict))

    whole = score(batch)
    read = np.asarray(batch.mask) != 0
    for budget in (16, 64):
        plan, parts = zip(*micro_batches(batch, budget))
        assert len(plan) > 1 or budget == 64
        packed = unpermute([score(mb) for mb in parts], plan, *whole.shape)
        assert_bits_equal(packed[read], whole[read], f"micro-batches of {budget} tokens")


@pytest.mark.slow
def test_learner_logprobs_do_not_depend_on_the_padded_length(tiny):
    """pack pads 300 tokens to T = 320 (not a power of two); the same rows padded to 512 give every
    logprob the same bits (KV blocks and splits sit at absolute positions; padding is never seen)."""
    cfg, params = tiny
    master = jax.tree.map(lambda w: w.astype(jnp.float32), params)
    rng = np.random.default_rng(2)
    samples = [
        as_sample(rng.integers(0, 256, n).tolist(), rng.integers(0, 256, 40).tolist(), np.zeros(40)) for n in (260, 30)
    ]
    batch = pack(samples)
    assert batch.tokens.shape == (2, 320)
    wider = [np.pad(batch.tokens, ((0, 0), (0, 192))), np.pad(batch.positions, ((0, 0), (0, 192)), constant_values=-1)]
    rope = model.rope_tables(cfg)
    score_fn = jax.jit(policy_logprobs, static_argnames="setting")
    strict = model.LearnerPass(cfg, "strict")
    at_320 = np.asarray(score_fn(master, model.Sequences(batch.tokens, batch.positions, batch.temps), rope, strict))
    at_512 = np.asarray(score_fn(master, model.Sequences(*wider, batch.temps), rope, strict))
    assert_bits_equal(at_512[:, :319], at_320, "T = 512 vs 320")


def learner_step(cfg, params, **options):
    """The FSDP learner step (loss, logp_new, gradients) on a small random batch, with `options` (remat,
    numerics) over strict numerics."""
    rng = np.random.default_rng(1)
    samples = [
        as_sample(
            rng.integers(0, 256, int(rng.integers(2, 12))).tolist(),
            rng.integers(0, 256, 5).tolist(),
            rng.uniform(-6, -0.1, 5).astype(np.float32),
            adv=float(rng.normal()),
            temperature=0.7,
        )
        for _ in range(4)
    ]
    batch = pack(samples)
    mesh = fsdp.make_mesh(jax.devices()[:1])
    specs = fsdp.param_specs(params, 1)
    master = fsdp.put(params, mesh, specs, dtype=jnp.float32)
    rope = fsdp.put(model.rope_tables(cfg), mesh, fsdp.REPLICATED)
    total = fsdp.put(np.float32(batch.mask.sum()), mesh, fsdp.REPLICATED)
    ref_logp = fsdp.put(np.zeros(batch.logp_old.shape, np.float32), mesh, fsdp.ROWS)
    on_mesh = fsdp.put(batch, mesh, fsdp.ROWS)
    objective = Objective(model.LearnerPass(cfg, **{"numerics": "strict", **options}), clip_eps=0.2, beta=0.0)
    grad_fn = fsdp.sharded_value_and_grad(grpo_loss, mesh, specs, dtype=cfg.dtype, objective=objective)
    zeros = jax.tree.map(jnp.zeros_like, master)
    (loss, (_, logp)), grads = grad_fn(master, on_mesh, ref_logp, rope, total, zeros)
    return loss, logp, grads


@pytest.fixture(scope="module")
def default_step(tiny):
    """The learner step with the default options, built once for the tests that compare a variant with it
    (each build traces and lowers the whole step again)."""
    return learner_step(*tiny)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["qkv", "on"])
def test_learner_remat_keeps_the_bits(tiny, default_step, remat):
    """--remat qkv and on (model.forward's remat) recompute each layer's first half, or both halves, in the backward
    pass rather than keeping their intermediates: the FSDP learner step's loss, logp_new and every gradient have the
    bits of the step that keeps them all."""
    loss, logp, grads = learner_step(*tiny, remat=remat)
    loss_kept, logp_kept, grads_kept = default_step
    assert_bits_equal(loss, loss_kept, "loss")
    assert_bits_equal(logp, logp_kept, "logp_new")
    assert np.abs(np.asarray(grads["layers"]["gate_proj"])).max() > 0  # a real gradient reached the layers
    for (path, g), g_kept in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_kept)):
        assert_bits_equal(g, g_kept, jax.tree_util.keystr(path))


@pytest.mark.slow
def test_learner_reads_weights_in_place_with_the_same_bits(monkeypatch):
    """The learner's pass on whole weights (model.Unstacked, the default) runs its layers unrolled,
    with every matrix read in place from its stack (matmul.matmul with its stack), forward and dx.
    Against the FSDP learner's weight path (fsdp.Gathered: a scan over per-layer slices, each weight
    all-gathered, on a one-device mesh) and with --remat, the GRPO loss, logp_new and every gradient
    have the same bits, and the in-place kernels did run: the model's matrices here are tile
    multiples, unlike qwen3-tiny's."""
    from pallas_kernels import matmul

    cfg = rlkjax.ModelConfig(512, 128, 2, 4, 2, 64, 256, tie_embeddings=True, max_position=1024)
    master = jax.tree.map(lambda w: w.astype(jnp.float32), rlkjax.init_params(cfg, seed=3))
    rng = np.random.default_rng(2)
    b, t = 2, 8
    batch = Batch(
        tokens=jnp.asarray(rng.integers(0, 512, (b, t)), jnp.int32),
        positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
        logp_old=jnp.asarray(rng.uniform(-6, -0.1, (b, t - 1)), jnp.float32),
        mask=jnp.ones((b, t - 1), jnp.float32),
        adv=jnp.asarray([1.0, -0.5], jnp.float32),
        temps=jnp.ones((b,), jnp.float32),
        tis=jnp.ones((b, t - 1), jnp.float32),
    )
    stacked_reads = []
    product = matmul.product
    monkeypatch.setattr(
        matmul,
        "product",
        lambda *a, **k: stacked_reads.append(len(a) > 5 and a[4] == "nn" and a[5] is not None) or product(*a, **k),
    )
    rope, ref = model.rope_tables(cfg), jnp.zeros((b, t - 1), jnp.float32)

    total = jnp.float32(b * (t - 1))

    def objective(remat="off"):
        return Objective(model.LearnerPass(cfg, "strict", remat), clip_eps=0.2, beta=0.0)

    def step(remat="off"):
        return jax.value_and_grad(grpo_loss, has_aux=True)(master, batch, ref, rope, total, objective(remat))

    def gathered(master):
        layers = fsdp.Gathered(master["layers"], specs=specs["layers"], dtype=cfg.dtype)
        return grpo_loss(master, batch, ref, rope, total, objective(), layers=layers)

    (loss, (_, logp)), grads = step()
    assert sum(stacked_reads) == 2 * 7, "every matrix's dx should read its stack in place"
    assert np.abs(np.asarray(grads["layers"]["down_proj"])).max() > 0
    mesh, specs = fsdp.make_mesh(jax.devices()[:1]), fsdp.param_specs(master, 1)
    scan = jax.shard_map(
        jax.value_and_grad(gathered, has_aux=True), mesh=mesh, in_specs=(specs,), out_specs=P(), check_vma=False
    )(master)
    for label, ((loss_s, (_, logp_s)), grads_s) in (("gathered layer scan", scan), ("unrolled, remat", step("on"))):
        assert_bits_equal(loss, loss_s, f"loss, {label}")
        assert_bits_equal(logp, logp_s, f"logp_new, {label}")
        for (path, g), g_s in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_s), strict=True):
            assert_bits_equal(g, g_s, f"{jax.tree_util.keystr(path)}, {label}")


def backward_variants(tiny, default_step, field, other):
    """The learner step with NumericsOptions(field=other) against the default step: asserts the loss and
    logp_new keep their bits (a backward choice must not touch the forward), then yields (path,
    gradient with the default, gradient with the other) per parameter, as float64."""
    from rlkjax.core.numerics import NumericsOptions

    loss, logp, grads = default_step
    loss_d, logp_d, grads_d = learner_step(*tiny, numerics=NumericsOptions(**{field: other}))
    assert_bits_equal(loss, loss_d, "loss")
    assert_bits_equal(logp, logp_d, "logp_new")
    for (path, g), g_d in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_d), strict=True):
        yield jax.tree_util.keystr(path), np.asarray(g, np.float64), np.asarray(g_d, np.float64)


@pytest.mark.slow
def test_flash_attention_backward_in_the_learner(tiny, default_step):
    """The flash attention backward (default) against XLA's dense one: the learner step's loss and
    logp_new keep their bits (only the attention's gradient changes implementation) and every
    gradient is finite and reaches its weights. Its accuracy (within twice the dense backward's own
    error against float64) is checked where it can be derived, on the attention alone:
    test_kernels' test_attention_flash_backward."""
    for path, g, g_d in backward_variants(tiny, default_step, "attention_backward", "dense"):
        assert np.isfinite(g).all() and (np.abs(g).max() > 0) == (np.abs(g_d).max() > 0), path


@pytest.mark.slow
def test_matmul_backward_in_place_in_the_learner(tiny, default_step):
    """NumericsOptions.matmul_backward: in place (default) vs transposed copies: the learner step's loss and
    logp_new keep their bits (the forward is untouched) and the gradients agree to within bf16 rounding:
    both accumulate in fp32 and round dx and dw to bf16 (relative 2^-8 each), so over this model's few
    layers they may differ by a few such roundings, never by more than 1% in norm per weight (in
    interpret mode they came out the same bits). Their accuracy against float64 is checked on the
    kernel: test_kernels' test_matmul_backward_in_place."""
    for path, g, g_d in backward_variants(tiny, default_step, "matmul_backward", "copies"):
        assert np.isfinite(g).all(), path
        assert np.linalg.norm(g - g_d) <= 0.01 * np.linalg.norm(g_d), path


def corrupt_one_logprob(monkeypatch, at_step: int, sequence: int, token: int) -> dict:
    """At the `at_step`-th rollout, move one recorded logprob (completion token `token` of batch
    sequence `sequence`) one float32 ulp down: a sampler that broke the contract by the least amount.
    Returns what the error must name (filled in when it happens)."""
    original, calls, seen = rollout.LocalRollout.sample_turns, [], {}

    def sample_turns(self, prompts, seeds, samplings):  # a step's one rollout call: its one-turn episodes
        groups = original(self, prompts, seeds, samplings)
        group = samplings[0].n
        calls.append(None)
        if len(calls) == at_step:
            s = groups[sequence // group][sequence % group]
            logprobs = np.array(s.logprobs, np.float32)
            true, logprobs[token] = logprobs[token], np.nextafter(logprobs[token], np.float32(-np.inf))
            groups[sequence // group][sequence % group] = s._replace(logprobs=logprobs)
            seen.update(
                position=len(prompts[sequence // group]) + token,
                id=s.tokens[token],
                sampler=f"{float(logprobs[token])!r} (0x{int(logprobs[token : token + 1].view(np.uint32)[0]):08x})",
                learner=f"{float(true)!r} (0x{int(np.float32(true).view(np.uint32)):08x})",
            )
        return groups

    monkeypatch.setattr(rollout.LocalRollout, "sample_turns", sample_turns)
    return seen


@pytest.mark.parametrize("verify", [True, False])
def test_broken_contract_stops_the_run(tmp_path, monkeypatch, verify):
    """One logprob one ulp off stops strict training before any update, naming the step, the sequence
    (batch row 5 = prompt 1, sample 1 with G = 4) and the token with both values and their bits. With
    --verify-every 1 the sampler/learner comparison catches it; without, the first update's own
    logp_new (its ratio must be exactly 1) does."""
    seen = corrupt_one_logprob(monkeypatch, at_step=1, sequence=5, token=1)
    with pytest.raises(guards.ContractError) as error:
        grpo.train(grpo.GRPOConfig(steps=1, verify_every=int(verify), out=str(tmp_path), **SMALL))
    message = str(error.value)
    what = "sampler vs learner logprobs" if verify else "first update's logp_new vs logp_old"
    assert message.startswith(f"step 1: {what}: 1 of "), message
    for part in (
        "sequence 5 of the batch (prompt 1, sample 1)",
        f"token position {seen['position']} (id {seen['id']})",
        f"sampler {seen['sampler']}",
        f"learner {seen['learner']}",
        "--on-mismatch warn",
    ):
        assert part in message, (part, message)
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_broken_contract_warn_keeps_training(tmp_path, monkeypatch, caplog):
    """--on-mismatch warn: the same corruption at step 2 is logged by both checks, and the update is
    still applied and the run finishes (final checkpoint written); the metrics record the one token."""
    seen = corrupt_one_logprob(monkeypatch, at_step=2, sequence=6, token=0)
    with caplog.at_level(logging.WARNING, logger="train.grpo"):
        result = grpo.train(grpo.GRPOConfig(steps=2, on_mismatch="warn", out=str(tmp_path), **SMALL))
    assert [r["tokens_bits_differ"] for r in result["history"]] == [0, 1]
    assert (tmp_path / "checkpoints" / "2").is_dir()
    warnings = [r.getMessage() for r in caplog.records if r.name == "train.grpo"]
    assert len(warnings) == 2, warnings
    for what, message in zip(("sampler vs learner logprobs", "first update's logp_new vs logp_old"), warnings):
        assert f"step 2: {what}: 1 of " in message and "sequence 6 of the batch (prompt 1, sample 2)" in message, (
            message
        )
        assert (
            f"token position {seen['position']}" in message
            and seen["sampler"] in message
            and seen["learner"] in message
        )


@pytest.mark.slow
def test_smoke_subprocess(tmp_path):
    """`python -m train.grpo` for 2 steps (the warmup makes the first update's rate 0; the second moves
    every weight): finite loss, mismatch 0 and first-update ratio exactly 1 every step, every parameter
    changed, plot and HF export written."""
    out = tmp_path / "run"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "train.grpo",
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--max-new-tokens",
            "4",
            "--max-prompt-tokens",  # SMALL's: the in-process runs' programs, from the run's compilation cache
            "16",
            "--verify-every",
            "1",
            "--learning-rate",
            "1e-2",
            "--out",
            str(out),
            "--no-progress",
        ],
        check=True,
        timeout=600,
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert (
            np.isfinite(r["loss"])
            and r["tokens_bits_differ"] == 0
            and r["max_abs_delta"] == 0.0
            and r["tokens_compared"] == r["completion_tokens_mean"] * 8 <= 32  # 2 x 4 completions; eos may end some
        )
        assert r["ratio_min"] == 1.0 and r["ratio_max"] == 1.0
    assert (out / "plot.png").stat().st_size > 10_000
    cfg0 = rlkjax.ModelConfig.preset("qwen3-tiny")
    before = rlkjax.init_params(cfg0, seed=0)
    cfg, after = rlkjax.load_hf_checkpoint(out / "final_hf")
    assert cfg == cfg0
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(before), jax.tree.leaves(after)):
        changed = np.asarray(a.astype(jnp.float32)) != np.asarray(b.astype(jnp.float32))
        assert changed.any(), f"{jax.tree_util.keystr(path[0])} did not change"


def _params_bits(master):
    return [np.asarray(x).view(np.uint32) for x in jax.tree.leaves(master)]


@pytest.mark.slow
def test_resume_and_same_seed_are_bit_identical(tmp_path):
    base = grpo.GRPOConfig(steps=2, checkpoint_every=1, **SMALL)
    straight = grpo.train(dataclasses.replace(base, out=str(tmp_path / "a")))
    again = grpo.train(dataclasses.replace(base, out=str(tmp_path / "b")))
    grpo.train(dataclasses.replace(base, steps=1, out=str(tmp_path / "c")))
    resumed = grpo.train(dataclasses.replace(base, out=str(tmp_path / "c"), resume=True))
    for name, other in (("same seed", again), ("1 + resume 1", resumed)):
        for x, y in zip(_params_bits(straight["master"]), _params_bits(other["master"])):
            assert np.array_equal(x, y), name
    rows = [json.loads(line) for line in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--group-size", "1"], "--group-size=1"),
        (["--learning-rate", "nan"], "--learning-rate=nan"),
        (["--clip-eps", "1.5"], "--clip-eps=1.5"),
        (["--beta", "nan"], "--beta=nan must be finite"),
        (["--temperature", "1e-46"], "--temperature must be finite"),
        (["--seed", "-1"], "--seed must be an integer"),
        (["--tis-cap", "2"], "--tis-cap"),
        (["--task", "gsm8k"], "--data"),
        (["--model", "/nonexistent"], "/nonexistent"),
    ],
)
def test_bad_flags_name_the_bad_value(flags, match, tmp_path, capsys, monkeypatch):
    """The command line's parser and train() in this process (test_smoke_subprocess runs the entry point
    itself): the error, printed by the parser or raised before any program is built, names the bad value."""
    monkeypatch.setenv("COLUMNS", "400")  # the parser's error box must not wrap the message
    with pytest.raises((SystemExit, ValueError)) as error:
        grpo.train(tyro.cli(grpo.GRPOConfig, args=["--out", str(tmp_path), *flags]))
    message = capsys.readouterr().err if error.type is SystemExit else str(error.value)
    assert match in " ".join(message.split()), message[-2000:]


def test_tasks_reward_by_hand(tmp_path):
    assert LowercaseTask().reward(Example("X:"), "ab1C") == 0.5
    assert ArithmeticTask().reward(Example("2+3=", "5"), " 5 apples") == 1.0
    assert ArithmeticTask().reward(Example("2+3=", "5"), "6") == 0.0
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "so #### 1,000"}) + "\n")
    task = GSM8KTask(path)
    assert task.reward(task.examples[0], "the answer is 1,000.") == 1.0 and task.reward(task.examples[0], "999") == 0.0


def length_reward(prompt: str, completion: str) -> float:
    """A user reward for the --reward test: longer completions score higher."""
    return len(completion) / 100


@pytest.mark.slow
def test_fast_numerics_with_tis_and_a_user_reward(tmp_path):
    """--numerics fast runs end to end with truncated importance sampling, and --reward replaces
    the task's reward with a user function."""
    result = grpo.train(
        grpo.GRPOConfig(
            steps=2,
            runtime=Runtime(numerics="fast"),
            tis_cap=2.0,
            reward="tests.test_grpo:length_reward",
            out=str(tmp_path),
            **SMALL,
        )
    )
    for row in result["history"]:
        assert np.isfinite(row["loss"]) and row["tokens_compared"] == 32
        assert 0 <= row["reward_mean"] <= 0.04  # at most 4 tokens of text -> <= 4 bytes / 100


def test_hf_tokenizer_json(tmp_path):
    """A checkpoint's tokenizer.json (built here with the `tokenizers` library) and its eos token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from rlkjax.text.tokenizer import ByteTokenizer, load_tokenizer

    vocab = {"<|im_end|>": 0, "hello": 1, "world": 2, "[UNK]": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    hf = load_tokenizer(tmp_path)
    assert hf.encode("hello world") == [1, 2] and hf.eos_token_id == 0 and "hello" in hf.decode([1, 2])
    assert isinstance(load_tokenizer("qwen3-tiny"), ByteTokenizer) and load_tokenizer(None).decode(list(b"ok")) == "ok"
    # A checkpoint without tokenizer.json must not silently get byte ids: an error, unless named explicitly.
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(ValueError, match="no tokenizer.json.*--tokenizer"):
        load_tokenizer(bare)
    assert isinstance(load_tokenizer(bare, "bytes"), ByteTokenizer)
    assert load_tokenizer(bare, tmp_path).encode("hello") == [1]


def check_completions_end_at_eos(groups, max_new_tokens):
    """Each completion is max_new_tokens long or ends with its only eos; returns how many ended early."""
    early = 0
    for s in (s for g in groups for s in g):
        assert EOS not in s.tokens[:-1], s.tokens
        assert len(s.tokens) == max_new_tokens or s.tokens[-1] == EOS, s.tokens
        early += len(s.tokens) < max_new_tokens
    return early


def test_model_eos():
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    assert rollout.model_eos(ByteTokenizer(), cfg) == EOS
    with pytest.raises(ValueError, match="eos id 256 is outside the model's vocabulary of 200"):
        rollout.model_eos(ByteTokenizer(), dataclasses.replace(cfg, vocab_size=200))


def test_training_stops_at_eos(tmp_path, monkeypatch):
    """A sampled eos ends the completion in training (it once ran on to --max-new-tokens): completions
    shorter than max_new_tokens end with eos, the loss mask covers exactly the completion through its eos,
    and the sampler's logprob bits, eos's included, are the learner's (strict numerics stop the run otherwise:
    --verify-every 1 and the first update's ratio of exactly 1 both check every masked token)."""
    original, seen = rollout.LocalRollout.sample_turns, []

    def sample_turns(self, prompts, *args):
        groups = original(self, prompts, *args)
        seen.append((prompts, groups))
        return groups

    monkeypatch.setattr(rollout.LocalRollout, "sample_turns", sample_turns)
    config = grpo.GRPOConfig(
        source=ModelSource(eos_model(tmp_path / "model"), tokenizer="bytes"),
        steps=1,
        checkpoint_every=0,
        out=str(tmp_path / "run"),
        **SMALL,  # the other runs' shapes: their programs, compiled once (3 of 8 completions end early here)
    )
    (row,) = grpo.train(config)["history"]
    (prompts, groups) = seen[0]
    assert check_completions_end_at_eos(groups, 4) >= 2
    samples = [as_sample(p, s.tokens, s.logprobs) for p, g in zip(prompts, groups) for s in g]
    batch = pack(samples)
    for i, s in enumerate(samples):
        first, n = len(s.prompt) - 1, len(s.tokens)
        assert np.flatnonzero(batch.mask[i]).tolist() == list(range(first, first + n))
        assert batch.tokens[i, first + n] == s.tokens[-1]  # the last masked column predicts eos (or the 4th token)
    assert row["tokens_bits_differ"] == 0 and row["tokens_compared"] == int(batch.mask.sum()) < 2 * 4 * 4
    assert row["completion_tokens_mean"] == batch.mask.sum() / 8


@pytest.mark.slow
def test_local_and_remote_rollouts_give_the_same_completions_and_remote_training(tmp_path):
    """The in-process engine and a `serve.rollout` server on loopback, same weights, prompts, seeds and
    sampling: the same tokens and logprob bits, eos-ended completions included (the server once sampled
    past eos while the engine did not know it). With ignore_eos both sample past eos to max_new_tokens
    (the server once added its eos to a request that asked to ignore it).
    Then train.grpo trains against the same server (--rollout-url; one server for both: each start
    compiles its programs again): every step's logprobs are the learner's bits, and the weights are
    pushed at the start and after each step but the last."""
    model_dir = eos_model(tmp_path / "model")
    cfg, params = rlkjax.load_hf_checkpoint(model_dir)
    devices = fsdp.pick_devices("learner_devices", "0")
    mesh = fsdp.make_mesh(devices)
    local = rollout.LocalRollout(params, cfg, "strict", mesh, devices, rows=8, max_length=32, group=4, eos_token_id=EOS)
    proc, client = start_server("--model", model_dir, "--tokenizer", "bytes")
    try:
        remote = rollout.RemoteRollout(client.url, ADMIN)
        prompts, seeds = [list(b"ab"), list(b"xyz")], [11, 12]
        for ignore_eos in (False, True):
            sampling = rlkjax.SamplingParams(n=4, max_tokens=8, ignore_eos=ignore_eos)
            a = local.sample(prompts, seeds, sampling)
            b = remote.sample(prompts, seeds, sampling)
            if not ignore_eos:
                assert check_completions_end_at_eos(a, 8) >= 2
            else:  # every completion runs to max_new_tokens, some through an eos
                assert all(len(s.tokens) == 8 for g in a for s in g)
                assert any(EOS in s.tokens[:-1] for g in a for s in g)
            for ga, gb in zip(a, b, strict=True):
                for sa, sb in zip(ga, gb, strict=True):
                    assert type(sa) is type(sb) is rollout.Completion and sa.tokens == sb.tokens
                    assert sa.policy_version == sb.policy_version
                    assert_bits_equal(sa.logprobs, sb.logprobs, "local vs remote logprobs")

        config = grpo.GRPOConfig(
            source=ModelSource(model_dir, tokenizer="bytes"),
            steps=2,
            out=str(tmp_path / "r"),
            rollout_url=client.url,
            admin_key=ADMIN,
            verify_every=1,
            **SMALL,
        )
        result = grpo.train(config)
        assert all(r["tokens_bits_differ"] == 0 and r["tokens_compared"] > 0 for r in result["history"])
        assert [r["policy_version"] for r in result["history"]] == [1, 2]  # pushed at start, then after step 1
        assert client.health()["policy_version"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def test_step_flops_and_mfu_by_hand():
    """train.grpo's FLOPs come from rlkjax.core.flops (it once counted 8N with no attention). qwen3-tiny (hidden 64,
    2 layers, 4 query heads of 16, 2 KV heads, FFN 128, vocab 512): matmul parameters per layer
    q, o 2 x 64 x 64 + k, v 2 x 64 x 32 + gate, up, down 3 x 64 x 128 = 36,864; x 2 layers + lm_head
    512 x 64 = 106,496. Attention per query-key pair: 2 x 4 x 16 = 128 times 2 forward, 6 trained.
    Rows of 5 and 3 real tokens (padded to 8; padding counts nothing):
      one update   6 x 106,496 x 8 + 6 x 128 x (25 + 9) = 5,111,808 + 26,112 = 5,137,920
      one scoring  2 x 106,496 x 8 + 2 x 128 x 34       = 1,703,936 +  8,704 = 1,712,640
    Rollout of a 3-token prompt and one 3-token completion: the prefill 2 x 106,496 x 3 + 2 x 128 x 9 =
    641,280 draws the first token; decode steps over contexts 4 and 5: 2 x (2 x 106,496) + 4 x 128 x 9 =
    430,592."""
    cfg = rlkjax.ModelConfig.preset("qwen3-tiny")
    batch = pack([as_sample([1, 2], [3, 4, 5], np.zeros(3)), as_sample([1], [3, 4], np.zeros(2))])
    assert metrics.learner_flops(cfg, batch, scoring_passes=1, updates=1) == 5_137_920 + 1_712_640
    sampled = [as_sample([1, 2, 3], [7, 8, 9], np.zeros(3))]  # one group of one
    assert metrics.rollout_flops(cfg, sampled, 1) == 641_280 + 430_592
    h200 = "NVIDIA H200"
    row = metrics.throughput(
        cfg,
        batch,
        sampled,
        1,
        {"learner": 2.0, "step": 4.0},
        {"learner": [h200], "all": [h200, h200]},
        scoring_passes=1,
        updates=1,
    )
    assert row["learner_pass_mfu"] == 6_850_560 / 2.0 / 989e12
    assert row["grpo_step_mfu"] == (6_850_560 + 1_071_872) / 4.0 / (2 * 989e12)
    assert row["learner_pass_tflops_per_device"] == 6_850_560 / 2.0 / 1e12
    cpu = metrics.throughput(
        cfg,
        batch,
        sampled,
        1,
        {"learner": 2.0, "step": 4.0},
        {"learner": ["cpu"], "all": ["cpu"]},
        scoring_passes=1,
        updates=1,
    )
    assert "learner_pass_mfu" not in cpu and cpu["grpo_step_tflops_per_device"] == 7_922_432 / 4.0 / 1e12
