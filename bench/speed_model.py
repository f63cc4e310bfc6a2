"""bench.speed's model rows: decode (a jitted loop of decode steps), prefill, the learner's value and
gradient (the library's pass and train.grpo's one-device step), and the scoring pass; strict and fast
side by side, each row a dict of numbers."""

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import F32, compiled_bytes, median_time, rand
from rlkjax.core import flops, model
from rlkjax.core.numerics import PAGE_SIZE, NumericsOptions
from rlkjax.engine.programs import prefill_chunk
from train import fsdp
from train.batch import Batch
from train.loss import Objective, grpo_loss

SIDES = ("fast", "strict")


def mfu(model_flops, seconds):
    """MFU on this run's device (rlkjax.core.flops); None where its peak is unknown (the CPU)."""
    return flops.mfu(model_flops, seconds, jax.devices()[0])


def weight_bytes(params):
    """What a decode step reads: every weight once (the embedding gather reads B rows, so a tied
    embedding counts once, as the lm_head)."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    return total - (params["embed_tokens"].nbytes if "lm_head" in params else 0)


@functools.partial(jax.jit, static_argnames=("cfg", "numerics", "steps"), donate_argnames=("cache",))
def decode_loop(params, tokens, start, cache, page_table, seeds, temps, rope, cfg, numerics, steps):
    """`steps` decode steps feeding each sampled token back in: the engine's decode_step, in one loop."""

    def body(i, carry):
        tok, cache, _ = carry
        hidden, cache = model.forward(params, tok, (start + i)[:, None], cache, page_table, rope, cfg, numerics)
        nxt, lp = model.sample(params, hidden[:, 0], seeds, jnp.full_like(seeds, i), temps, numerics)[:2]
        return nxt[:, None], cache, lp

    tok, cache, lp = jax.lax.fori_loop(0, steps, body, (tokens, cache, jnp.zeros(tokens.shape[0], F32)))
    return tok, lp, cache


@functools.partial(jax.jit, static_argnames=("cfg", "num_pages"))
def random_cache(cfg, num_pages):
    """KV pages filled with random bf16 values (a random block tiled, so no fp32 temporary)."""
    block = rand(5, (cfg.num_layers, cfg.num_kv_heads, 16, PAGE_SIZE, cfg.head_dim))
    reps = -(-num_pages // 16)
    k = jnp.tile(block, (1, 1, reps, 1, 1))[:, :, :num_pages]
    return k, jnp.flip(k, axis=2)


def decode_rows(cfg, params, batches, contexts, steps, repeats, bw, name, unroll=1):
    """Decode rows; unroll: the sampler's layer-loop unroll (NumericsOptions.layer_unroll) they run with.
    Each (batch, context, side) gets a cache of its own size, so long contexts fit as far as memory
    allows; a side that does not fit (Qwen3-8B at batch 16 and 32k keys needs ~78 GB of KV cache)
    records its error and the rows go on."""
    rows = []
    rope = model.rope_tables(cfg)
    wbytes = weight_bytes(params)
    for batch in batches:
        seeds, temps = jnp.arange(batch, dtype=jnp.uint32), jnp.ones((batch,), F32)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, 1)), jnp.int32)
        for ctx in contexts:
            row = {"section": "decode", "model": name, "batch": batch, "context": ctx, "steps": steps}
            row |= {"layer_unroll": unroll} if unroll != 1 else {}
            start = jnp.full((batch,), ctx - 1, jnp.int32)
            pages_per_row = -(-(ctx + steps) // PAGE_SIZE)  # the fast path's attention reads every listed page
            table = jnp.asarray(1 + np.arange(batch * pages_per_row, dtype=np.int32).reshape(batch, pages_per_row))
            kv = batch * (ctx + steps / 2) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
            row["kv_bytes_per_step"] = kv
            for side in SIDES:
                state = {}

                def run():
                    options = NumericsOptions(mode=side, layer_unroll=unroll)
                    _, lp, state["cache"] = decode_loop(
                        params, tokens, start, state["cache"], table, seeds, temps, rope, cfg, options, steps
                    )
                    lp.block_until_ready()

                try:
                    state["cache"] = random_cache(cfg, 1 + batch * pages_per_row)
                    dt = median_time(run, repeats) / steps
                except jax.errors.JaxRuntimeError as e:  # out of memory is a result too
                    row[f"{side}_error"] = str(e)[:160]
                    continue
                finally:
                    state.clear()  # the cache goes before the next side's
                row[f"{side}_tokens_per_s"] = batch / dt
                row[f"{side}_ms_per_step"] = 1e3 * dt
                row[f"{side}_hbm_fraction"] = (wbytes + kv) / dt / bw
            if "strict_ms_per_step" in row and "fast_ms_per_step" in row:
                row["strict_over_fast"] = row["strict_ms_per_step"] / row["fast_ms_per_step"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def prefill_row(cfg, params, batch, length, repeats, rate, name):
    rope = model.rope_tables(cfg)
    pages_per_row = -(-length // PAGE_SIZE)
    page_table = jnp.asarray(1 + np.arange(batch * pages_per_row, dtype=np.int32).reshape(batch, pages_per_row))
    cache = model.init_kv_cache(cfg, 1 + batch * pages_per_row)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, length)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    work = flops.sequence_flops(cfg, [length] * batch, backward=False).model
    row = {"section": "prefill", "model": name, "batch": batch, "length": length, "model_flops": work}
    row["mfu_of"] = "prefill pass"
    for side in SIDES:

        def run():
            nonlocal cache
            cache = prefill_chunk(params, tokens, positions, cache, page_table, rope, cfg, side)
            jax.block_until_ready(cache)

        dt = median_time(run, repeats)
        row[f"{side}_tokens_per_s"] = batch * length / dt
        row[f"{side}_mfu"] = mfu(work, dt)
        row[f"{side}_dot_fraction"] = work / dt / rate
    row["strict_over_fast"] = row["fast_tokens_per_s"] / row["strict_tokens_per_s"]
    print(json.dumps(row), flush=True)
    return row


def learner_batch(cfg, b, seq):
    """Random recorded sequences [b, seq] as the learner's typed Batch (every token trained)."""
    rng = np.random.default_rng(0)
    return Batch(
        tokens=jnp.asarray(rng.integers(0, cfg.vocab_size, (b, seq)), jnp.int32),
        positions=jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (b, seq)),
        logp_old=jnp.asarray(-rng.random((b, seq - 1)) * 3, F32),
        mask=jnp.ones((b, seq - 1), F32),
        adv=jnp.asarray(rng.standard_normal(b), F32),
        temps=jnp.ones((b,), F32),
        tis=jnp.ones((b, seq - 1), F32),
    )


def train_learner_step(master, batch, ref, rope, cfg, remat, options="strict"):
    """train.grpo's learner step on one device, as train() builds it: fsdp.sharded_value_and_grad on a
    one-device mesh (whole weights, as the library's pass: fsdp.gather only casts there; gradients
    added into a donated running sum). Returns (jitted step, its arguments but the running sum, a fresh running sum)."""
    mesh = fsdp.make_mesh(jax.devices()[:1])
    specs = fsdp.param_specs(master, 1)
    objective = Objective(model.LearnerPass(cfg, options, remat), clip_eps=0.2, beta=0.0)
    step = fsdp.sharded_value_and_grad(grpo_loss, mesh, specs, dtype=cfg.dtype, objective=objective)
    on_mesh = fsdp.put(master, mesh, specs, dtype=F32)
    tokens = float(np.asarray(batch.mask).sum())
    args = (
        on_mesh,
        fsdp.put(batch, mesh, fsdp.ROWS),
        fsdp.put(ref, mesh, fsdp.ROWS),
        fsdp.put(rope, mesh, fsdp.REPLICATED),
        fsdp.put(np.float32(tokens), mesh, fsdp.REPLICATED),
    )
    return step, args, jax.tree.map(jnp.zeros_like, on_mesh)


def learner_row(cfg, name, seq, tokens_per_call, repeats, rate, remat="off", sides=SIDES, strict="strict"):
    """sides: "fast" and "strict" run grpo_loss on whole weights (the library's learner pass:
    layers unrolled, weights read in place); "train" runs train.grpo's one-device learner step
    (`train_learner_step`, strict), so the two can be compared in one run."""
    b = max(1, tokens_per_call // seq)
    master = model.init_params(cfg, seed=0, dtype=F32)
    batch = learner_batch(cfg, b, seq)
    rope = model.rope_tables(cfg)
    ref = jnp.zeros((b, seq - 1), F32)
    work = flops.sequence_flops(cfg, [seq] * b, backward=True).model
    row = {"section": "learner", "model": name, "seq": seq, "batch": b, "remat": remat, "model_flops": work}
    row["mfu_of"] = "learner pass"
    for side in sides:
        if side == "train":
            fn, args, grads = train_learner_step(master, batch, ref, rope, cfg, remat, strict)
            args = (*args, grads)
        else:
            fn = jax.jit(jax.value_and_grad(grpo_loss, has_aux=True), static_argnums=5)
            policy = model.LearnerPass(cfg, strict if side == "strict" else side, remat)
            args = (master, batch, ref, rope, jnp.float32(b * seq), Objective(policy, clip_eps=0.2, beta=0.0))
        try:
            start = time.perf_counter()
            compiled = fn.lower(*args).compile()
            row[f"{side}_compile_s"] = time.perf_counter() - start
            if side == "train":  # the running sum is donated: each call takes the last one's
                state = {"grads": args[-1]}

                def call():
                    state["grads"] = jax.block_until_ready(compiled(*args[:-1], state["grads"]))[1]

            else:

                def call():
                    jax.block_until_ready(compiled(*args[:5]))  # the objective (static) is compiled in

            dt = median_time(call, repeats)
        except (jax.errors.JaxRuntimeError, NotImplementedError) as e:  # out of memory, a failed lowering: results too
            row[f"{side}_error"] = str(e)[:160]
            continue
        row[f"{side}_tokens_per_s"] = b * seq / dt
        row[f"{side}_mfu"] = mfu(work, dt)
        row[f"{side}_dot_fraction"] = work / dt / rate
        row[f"{side}_memory_GiB"] = compiled_bytes(compiled) / 2**30
    if "fast_tokens_per_s" in row and "strict_tokens_per_s" in row:
        row["strict_over_fast"] = row["fast_tokens_per_s"] / row["strict_tokens_per_s"]
    print(json.dumps(row), flush=True)
    return row


def score_row(cfg, params, name, b, seq, repeats):
    rope = model.rope_tables(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (b, seq)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (b, seq))
    temps = jnp.ones((b,), F32)
    row = {"section": "score", "model": name, "batch": b, "seq": seq}
    for side in SIDES:
        fn = jax.jit(model.sequence_logprobs, static_argnames="setting")
        seqs = model.Sequences(tokens, positions, temps)
        compiled = fn.lower(params, seqs, rope, setting=model.LearnerPass(cfg, side)).compile()
        dt = median_time(lambda: jax.block_until_ready(compiled(params, seqs, rope)), repeats)
        row[f"{side}_tokens_per_s"] = b * seq / dt
        row[f"{side}_memory_GiB"] = compiled_bytes(compiled) / 2**30
    row["strict_over_fast"] = row["fast_tokens_per_s"] / row["strict_tokens_per_s"]
    print(json.dumps(row), flush=True)
    return row
