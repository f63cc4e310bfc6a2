"""The rollout engine: continuous batching, chunked prefill under a token budget, shared prompt
pages with copy-on-write, preemption, stop tokens, cancellation, weight swaps, and no recompiles
after warm-up, all under the bitwise contract (completion logprobs == rlkjax.score, exactly)."""

import dataclasses

import numpy as np
import pytest

import rlkjax
from rlkjax.core.checks import sample_seed
from rlkjax.core.numerics import NumericsOptions
from rlkjax.engine.engine import Engine
from rlkjax.engine.outputs import OutputQueue, SampleOutput
from rlkjax.engine.scheduler import Scheduler
from tests.helpers import ENGINE, ENGINE_4, ENGINE_TIGHT, assert_bits_equal, slow


@pytest.mark.slow  # the default run's no-recompile check: test_no_recompiles_after_warmup
def test_warm_up_compiles_every_default_shape(tiny):
    """After `warm_up` (what the server runs at start), a mixed workload (prompts up to 3 pages,
    n up to 3, so forks copy pages; batches from 1 to max_batch) triggers no XLA compilation at all:
    counted with JAX's own backend-compile events, so nothing compiled anywhere, not only in the
    engine's step functions. The warm-up's own compilations are counted too (the listener works)."""
    import jax

    cfg, params = tiny
    # Programs another test left in jit's caches would compile nothing at the warm-up. Dropped here, the
    # warm-up traces them again and JAX reports each compilation, also one its persistent cache answers
    # (the suite's programs of ENGINE_4 are compiled once per run, not again for a config of their own).
    jax.clear_caches()
    config = ENGINE_4
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        engine = Engine(params, cfg, config=config)
        shapes = engine.warm_up()
        # prefill batches of 1, 2 (token_budget / prefill_chunk); rounds of 4 and of 1 step, each of 4
        # rows (Engine.min_decode_rows); page copies of 1 ... 4 rows
        assert shapes == 2 + 1 + 1 + 3 and len(compiles) >= shapes, (shapes, len(compiles))
        warm = len(compiles)
        rng = np.random.default_rng(5)
        pending = list(random_workload(rng, cfg, 20))
        while pending or engine.busy:
            if pending and rng.random() < 0.5:
                engine.submit(**pending.pop())
            engine.step()
        for rows in (1, 4):  # rounds of one row and of max_batch rows
            reqs = [engine.submit([1, 2], max_tokens=2) for _ in range(rows)]
            engine.run_until_done()
            assert all(r.done.is_set() for r in reqs)
        assert len(compiles) == warm, f"{len(compiles) - warm} compilations after the warm-up"
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def check_exact(params, cfg, req, completion, temperature):
    scored = rlkjax.score(params, cfg, [req.prompt + completion.tokens], [len(req.prompt)], temperature=temperature)[0]
    assert_bits_equal(completion.logprobs, scored, f"request {req.id}")


def token_at(params, cfg, kw, max_new_tokens, index):
    """Token `index` that sample 0 of the workload request `kw` draws (to make it a stop id mid-round)."""
    return alone(params, cfg, kw["prompt"], max_new_tokens, kw["temperature"], kw["seed"]).tokens[index]


def alone(params, cfg, prompt, max_new_tokens, temperature, seed):
    """The completion one sample draws alone, on an engine of the shared config (rlkjax.generate would
    size an engine per prompt length, and compile its step functions again for each)."""
    engine = Engine(params, cfg, config=ENGINE)
    req = engine.submit(prompt, max_tokens=max_new_tokens, temperature=temperature, seed=seed)
    engine.run_until_done()
    return req.results[0]


def random_workload(rng, cfg, count, max_new=8):
    for _ in range(count):
        yield dict(
            prompt=rng.integers(0, cfg.vocab_size, int(rng.integers(1, 60))).tolist(),
            n=int(rng.integers(1, 4)),
            max_tokens=int(rng.integers(1, max_new + 1)),
            temperature=float(rng.choice([0.7, 1.0, 1.3])),
            seed=int(rng.integers(0, 2**32)),
        )


@pytest.mark.parametrize(
    "config",
    [slow(ENGINE), ENGINE_TIGHT],
    ids=["roomy", "tight-pages-preempt"],
)
def test_random_schedules_keep_the_contract(tiny, config):
    """Requests arrive between steps in random order; in strict mode every completion equals score()
    bit for bit and has the tokens and bits the same sample gets alone (submitted with its seed)."""
    cfg, params = tiny
    rng = np.random.default_rng(config.num_pages)
    engine = Engine(params, cfg, config=config)
    tight = config == ENGINE_TIGHT  # 11 pages of 16 tokens: sequences must grow into each other
    pending = list(random_workload(rng, cfg, 10, max_new=40 if tight else 8))
    submitted = []
    while pending or engine.busy:
        for _ in range(int(rng.integers(0, 3))):
            if pending:
                kw = pending.pop()
                submitted.append((engine.submit(**kw), kw))
        engine.step()
    if tight:
        m = engine.metrics()
        assert m["preemptions"] > 0, "the tight config must force preemption"
        # preempted and finished sequences' kept pages were taken again (rlkjax.engine.prefix_cache), exactly
        assert m["prefix_cache_hit_tokens"] > 0 and m["prefix_cache_evictions"] > 0, m
    assert engine.pages.used == 0, "every page is returned"
    # Each sample checked alone on one engine of one size (rlkjax.generate would size an engine per
    # prompt length, and compile its step functions again for each).
    alone = Engine(params, cfg, config=ENGINE)
    for req, kw in submitted:
        assert req.done.is_set()
        for comp in req.results:
            assert comp.finish_reason == "length" and len(comp.tokens) == kw["max_tokens"]
            check_exact(params, cfg, req, comp, kw["temperature"])
        j = int(rng.integers(0, kw["n"]))
        lone = alone.submit(
            kw["prompt"], max_tokens=kw["max_tokens"], temperature=kw["temperature"], seed=sample_seed(kw["seed"], j)
        )
        alone.run_until_done()
        alone_result = lone.results[0]
        assert alone_result.tokens == req.results[j].tokens
        assert_bits_equal(alone_result.logprobs, req.results[j].logprobs, "alone vs scheduled")


def test_shared_prompt_pages_equal_unshared(tiny):
    """n=3 samples sharing a 37-token prompt's pages (2 full pages shared, the partial one copied)
    == three separate requests with the samples' seeds."""
    cfg, params = tiny
    prompt = list(range(100, 137))
    engine = Engine(params, cfg, config=ENGINE)
    shared = engine.submit(prompt, n=3, max_tokens=6, seed=11)
    for _ in range(3):  # prefill 16 + 16 + 4 of the 36 cached prompt tokens, then fork
        engine.step()
    assert max(engine.pages.refs) == 3
    engine.run_until_done()
    apart = [engine.submit(prompt, max_tokens=6, seed=sample_seed(11, j)) for j in range(3)]
    engine.run_until_done()
    for j in range(3):
        assert shared.results[j].tokens == apart[j].results[0].tokens
        assert_bits_equal(shared.results[j].logprobs, apart[j].results[0].logprobs, f"sample {j}")
    assert len({tuple(r.tokens) for r in shared.results}) == 3, "samples of one request differ"
    assert engine.pages.used == 0


def test_released_cache_frees_its_memory_and_comes_back_zeroed(tiny):
    """release_cache (train.grpo's learner turn) drops the KV pages' device arrays: no live array
    of the cache's shape remains; it refuses while a request is in flight; the next request gets
    a fresh cache and the same tokens and logprob bits as before the release."""
    import jax

    cfg, params = tiny
    engine = Engine(params, cfg, config=ENGINE)
    shape = engine.cache[0].shape
    first = engine.submit([7, 8, 9], n=2, max_tokens=6, seed=3)
    engine.step()
    with pytest.raises(RuntimeError, match="in flight"):
        engine.release_cache()
    engine.run_until_done()
    engine.release_cache()
    assert engine.cache is None and not any(x.shape == shape for x in jax.live_arrays())
    again = engine.submit([7, 8, 9], n=2, max_tokens=6, seed=3)
    engine.run_until_done()
    for a, b in zip(first.results, again.results):
        assert a.tokens == b.tokens
        assert_bits_equal(a.logprobs, b.logprobs, "after the release")
    assert engine.cache[0].shape == shape and engine.pages.used == 0


def test_stop_tokens_and_cancellation(tiny):
    cfg, params = tiny
    engine = Engine(params, cfg, config=ENGINE)
    probe = engine.submit([1, 2, 3], max_tokens=8, seed=5)
    engine.run_until_done()
    stop_at = probe.results[0].tokens[2]
    stopped = engine.submit([1, 2, 3], max_tokens=8, seed=5, stop_token_ids=[stop_at])
    long = engine.submit([4, 5, 6], n=2, max_tokens=200, seed=1)
    for _ in range(4):
        engine.step()
    engine.cancel(long)
    engine.run_until_done()
    first = probe.results[0].tokens.index(stop_at)
    assert (
        stopped.results[0].finish_reason == "stop" and stopped.results[0].tokens == probe.results[0].tokens[: first + 1]
    )
    assert [r.finish_reason for r in long.results] == ["cancelled", "cancelled"] and long.done.is_set()
    assert engine.pages.used == 0 and not engine.busy


def test_every_request_ends_once_and_is_counted(tiny):
    """requests == finished + cancelled + failed once idle, pages back to 0, whatever ended a request:
    a cancel before its forks started (such a request used to end uncounted: the server's /metrics
    showed it "submitted, never finished" forever), a cancel mid-decode, a cancel after it finished,
    and a step that raised mid-decode (the weights taken away under it), which `abort` ends as failed,
    pages and the round in flight included. The engine then serves a request with the same bits as
    before the failure."""
    cfg, params = tiny
    engine = Engine(params, cfg, config=ENGINE)
    before = engine.submit([7, 8, 9], max_tokens=6, seed=3)
    engine.run_until_done()
    forks_pending = engine.submit([1, 2, 3], n=3, max_tokens=8, seed=1)  # leader + 2 forks not started
    mid = engine.submit([4, 5], n=2, max_tokens=200, seed=2)
    engine.cancel(forks_pending)
    for _ in range(3):
        engine.step()
    engine.cancel(mid)
    engine.cancel(before)  # ended already: nothing changes
    engine.run_until_done()
    bad = engine.submit([6], max_tokens=50, seed=4)
    bystander = engine.submit([5, 6], max_tokens=50, seed=5)
    for _ in range(3):
        engine.step()
    assert engine.pages.used > 0 and engine.busy
    engine.params = None
    with pytest.raises(RuntimeError, match="released"):
        engine.step()
    assert engine.abort("engine error: test") == [bad, bystander]
    engine.params = params
    m = engine.metrics()
    assert (m["requests"], m["finished"], m["cancelled"], m["failed"]) == (5, 1, 2, 2)
    assert all(r.done.is_set() for r in (forks_pending, mid, bad, bystander)) and bad.error == "engine error: test"
    assert [c.finish_reason for c in forks_pending.results] == ["cancelled"] * 3
    assert engine.pages.used == 0 and not engine.busy
    again = engine.submit([7, 8, 9], max_tokens=6, seed=3)
    engine.run_until_done()
    assert again.results[0].tokens == before.results[0].tokens
    assert_bits_equal(again.results[0].logprobs, before.results[0].logprobs, "after abort")
    assert engine.metrics()["finished"] == 2


def test_no_recompiles_after_warmup(tiny):
    """A long mixed workload compiles each step function once per batch bucket, then never again."""
    cfg, params = tiny
    engine = Engine(params, cfg, config=ENGINE)
    rng = np.random.default_rng(3)
    for kw in random_workload(rng, cfg, 12):  # warm-up: fills every bucket up to max_batch
        engine.submit(**kw)
    engine.run_until_done()
    for rows in (1, 2, 4, 8):  # rounds of every row count, of both lengths (all run at ENGINE's 8 rows)
        for max_tokens in (1, ENGINE.decode_steps):
            for _ in range(rows):  # a one-token prompt has nothing to prefill: the rows decode together
                engine.submit([1], max_tokens=max_tokens)
            engine.run_until_done()
    from rlkjax.engine import engine as eng

    def compiled(fn):  # programs jit compiled, or executables the executable cache holds where it is on
        return fn.fn._cache_size() + len(fn.loaded)

    sizes = (compiled(eng.next_round), compiled(eng.prefill_chunk), compiled(eng.copy_pages))
    seen = set(engine.shapes_seen)
    pending = list(random_workload(rng, cfg, 25))
    while pending or engine.busy:
        if pending and rng.random() < 0.7:
            engine.submit(**pending.pop())
        engine.step()
    assert engine.shapes_seen <= seen | {("copy_pages", 1), ("copy_pages", 2), ("copy_pages", 4)}
    assert compiled(eng.next_round) == sizes[0] and compiled(eng.prefill_chunk) == sizes[1]


def test_weight_update_between_steps(tiny):
    """A swap waits for in-flight sequences (they finish on version 0), then new requests run on
    version 1 and are exact under the new weights."""
    cfg, params = tiny
    new_params = rlkjax.init_params(cfg, seed=1)
    engine = Engine(params, cfg, config=ENGINE)
    old = engine.submit([9, 8, 7], max_tokens=6, seed=2)
    engine.step()
    engine.update_weights(new_params)
    queued = engine.submit([9, 8, 7], max_tokens=6, seed=2)
    engine.run_until_done()
    assert old.results[0].policy_version == 0 and queued.results[0].policy_version == 1
    check_exact(params, cfg, old, old.results[0], 1.0)
    check_exact(new_params, cfg, queued, queued.results[0], 1.0)
    assert old.results[0].tokens != queued.results[0].tokens


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompt=[]), "non-empty"),
        (dict(prompt=[1, 600]), "outside"),
        (dict(prompt=[1.5]), "integer"),
        (dict(n=0), "n must be"),
        (dict(n=99), "n must be"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=10**6), "context"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=5e-5), "temperature"),  # 0 is greedy; 0 < T < 1e-4 underflows
        (dict(seed=-3), "seed"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(min_tokens=17), "min_tokens"),  # more than max_tokens (16)
        (dict(top_logprobs=21), "top_logprobs"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(truncated_logprobs=1), "truncated_logprobs"),
        (dict(truncated_logprobs=True, top_logprobs=2), "cannot be combined"),
        (dict(ignore_eos=None), "ignore_eos"),
    ],
)
def test_submit_rejects_bad_requests(tiny, kwargs, match):
    cfg, params = tiny
    engine = Engine(params, cfg, config=ENGINE)
    with pytest.raises(ValueError, match=match):
        engine.submit(**(dict(prompt=[1, 2]) | kwargs))
    assert not engine.busy


def test_two_weight_updates_before_a_swap_both_complete(tiny):
    """Two updates queued while a sequence is in flight: both callers are released at the one swap
    (the first used to wait forever), the last weights are served, and the version moves once."""
    cfg, params = tiny
    engine = Engine(params, cfg, config=ENGINE)
    running = engine.submit([9, 8, 7], max_tokens=4, seed=2)
    engine.step()
    first = engine.update_weights(rlkjax.init_params(cfg, seed=1))
    second_params = rlkjax.init_params(cfg, seed=2)
    second = engine.update_weights(second_params)
    assert engine.weights_pending and not first.is_set()
    engine.run_until_done()
    assert first.is_set() and second.is_set() and not engine.weights_pending
    assert running.results[0].policy_version == 0 and engine.policy_version == 1
    after = engine.submit([9, 8, 7], max_tokens=4, seed=2)
    engine.run_until_done()
    check_exact(second_params, cfg, after, after.results[0], 1.0)


@pytest.mark.slow
def test_forked_samples_respect_max_batch(tiny):
    """n = 4 samples while another request holds 2 of 4 slots: the forks that find no slot wait
    holding their pages, the batch never exceeds 4, and every sample is exact (a parked one draws
    the tokens its seed draws alone)."""
    cfg, params = tiny
    engine = Engine(params, cfg, config=ENGINE_4)
    other = engine.submit([5, 6, 7, 8], n=2, max_tokens=30, seed=3)  # still decoding when req forks
    req = engine.submit(list(range(20, 57)), n=4, max_tokens=5, seed=7)
    widest, parked = 0, False
    while engine.busy:
        engine.step()
        widest = max(widest, len(engine.scheduler.running))
        parked = parked or any(s.pages for s in engine.scheduler.waiting)
    assert widest <= 4 and parked, (widest, parked)
    for r in (other, req):
        for comp in r.results:
            assert len(comp.tokens) == r.sampling.max_tokens
            check_exact(params, cfg, r, comp, 1.0)
    assert alone(params, cfg, req.prompt, 5, 1.0, sample_seed(7, 3)).tokens == req.results[3].tokens
    assert engine.pages.used == 0


def test_rounds_continue_on_the_device_exactly(tiny, monkeypatch):
    """The next round is dispatched before the one in flight is read (its rows continue from the
    device's last token). The same workload, with stops and min_tokens landing mid-round and a hook
    that stops a sample on the host, run that way and with every round read before the next is
    dispatched: the same tokens, finish reasons and logprob bits (the host-stopped sample's up to the
    stop: the tokens the engine sampled before it saw the stop depend on when rounds are read), every page
    back, and rows did continue on the device (none in the reference run)."""
    cfg, params = tiny
    rng = np.random.default_rng(11)
    work = list(random_workload(rng, cfg, 8, max_new=14))
    work[0] |= dict(n=2, stop_token_ids=[token_at(params, cfg, work[0], 14, 4)], min_tokens=3)  # sample 0: 5th token
    work[1] |= dict(max_tokens=14)

    def stop_after_six(engine, req):  # the host's stop, as a stop string found in a sample's text asks for it
        seen = [0] * req.sampling.n
        while engine.busy:
            engine.step()
            for out in req.outputs.drain():
                if isinstance(out, SampleOutput):
                    if seen[out.index] < 6 <= seen[out.index] + len(out.tokens):
                        engine.stop(req, out.index)
                    seen[out.index] += len(out.tokens)

    results = {}
    for chained in (True, False):
        if not chained:  # the engine's own fallback when pages are short: read the round first
            monkeypatch.setattr(Scheduler, "pages_ahead", lambda self, previous: False)
        engine = Engine(params, cfg, config=ENGINE)
        reqs = [
            engine.submit(**(kw | {"outputs": OutputQueue(rounds=True)} if i == 1 else kw)) for i, kw in enumerate(work)
        ]
        stop_after_six(engine, reqs[1])
        assert engine.pages.used == 0 and not engine.busy
        assert (engine.stats["chained_rows"] > 0) == chained, engine.stats
        results[chained] = [r.results for r in reqs]
    assert [c.finish_reason for c in results[True][0]][0] == "stop" and results[True][1][0].finish_reason == "stop"
    assert len(results[True][1][0].tokens) >= 6 and len(results[False][1][0].tokens) >= 6
    for i, (req, on, off) in enumerate(zip(reqs, results[True], results[False])):
        for a, b in zip(on, off):
            if i == 1:  # what a stop string keeps: the first 6 tokens
                a, b = (dataclasses.replace(c, tokens=c.tokens[:6], logprobs=c.logprobs[:6]) for c in (a, b))
            assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
            assert_bits_equal(a.logprobs, b.logprobs, "continued on the device vs read first")
            check_exact(params, cfg, req, a, req.sampling.temperature)


def test_decode_rounds_run_at_least_the_rows_the_forward_carries(tiny):
    """A decode round of fewer rows than the strict forward carries anyway (numerics.padded_rows: one
    decode matmul tile, 16 rows on CUDA and interpreted, 32 on ROCm) runs at that many, or at
    max_batch where that is fewer: a server's warm-up and every generate call compile one decode
    bucket for them rather than one per power of two. The fast path pads nothing and keeps them all."""
    cfg, params = tiny
    rocm = NumericsOptions(platform="rocm")
    rows = {
        (str(numerics), max_batch): Engine(params, cfg, numerics, dataclasses.replace(ENGINE, max_batch=max_batch))
        for numerics, max_batch in (("strict", 8), ("strict", 64), (rocm, 64), ("fast", 64))
    }
    assert {key: engine.min_decode_rows for key, engine in rows.items()} == {
        ("strict", 8): 8,
        ("strict", 64): 16,
        (str(rocm), 64): 32,
        ("fast", 64): 1,
    }
    warm_up = rows["strict", 64].warm_up_shapes()
    assert [r for name, r in warm_up if name == "decode_round"] == [16, 32, 64]
    assert [r for name, r in warm_up if name == "prefill"] == [1, 2]  # token_budget / prefill_chunk: unchanged


def test_one_token_requests_run_one_step_rounds(tiny):
    """A round runs all its steps, so a round in which no row may sample more than one token is a
    one-step round (not decode_steps steps on padding); its token and logprob bits are those of the
    first token of a longer request."""
    cfg, params = tiny
    engine = Engine(params, cfg, config=ENGINE)
    one = engine.submit([5, 6, 7], max_tokens=1, seed=3)
    engine.run_until_done()
    assert [key for name, key in engine.shapes_seen if name == "decode_round"] == [(8, 1, 0, False, 1)]
    longer = engine.submit([5, 6, 7], max_tokens=5, seed=3)
    engine.run_until_done()
    assert one.results[0].tokens == longer.results[0].tokens[:1]
    assert_bits_equal(one.results[0].logprobs, longer.results[0].logprobs[:1], "one-step round vs longer")
    check_exact(params, cfg, one, one.results[0], 1.0)


@pytest.mark.slow  # the default run's multi-step rounds check: test_rounds_continue_on_the_device_exactly
def test_decode_rounds_equal_single_steps(tiny):
    """The same workload with 1 and with 4 decode steps per round (stops and lengths landing
    mid-round): the same tokens and the same logprob bits; and a request that stops mid-round has
    every page back once its round ends."""
    cfg, params = tiny
    rng = np.random.default_rng(7)
    work = list(random_workload(rng, cfg, 6, max_new=12))
    stop = token_at(params, cfg, work[0], 12, 2)
    work[0] |= dict(n=1, max_tokens=12, stop_token_ids=[stop])  # stops at its 3rd token, mid-round
    results = {}
    for steps in (1, ENGINE.decode_steps):
        engine = Engine(params, cfg, config=dataclasses.replace(ENGINE, decode_steps=steps))
        reqs = [engine.submit(**kw) for kw in work]
        while not reqs[0].done.is_set():
            engine.step()
        assert reqs[0].results[0].finish_reason == "stop" and len(reqs[0].results[0].tokens) <= 3
        assert engine.pages.used == len({p for s in engine.scheduler.running for p in s.pages}), (
            "the stopped request's pages are free"
        )
        engine.run_until_done()
        assert engine.pages.used == 0
        results[steps] = [r.results for r in reqs]
    for one, rounds in zip(results[1], results[ENGINE.decode_steps]):
        for a, b in zip(one, rounds):
            assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
            assert_bits_equal(a.logprobs, b.logprobs, "multi-step rounds vs single steps")


@pytest.mark.parametrize("case", [slow("parked-fork"), "preempted"])
def test_weight_swap_waits_for_parked_and_preempted_sequences(tiny, case):
    """A sequence waiting with work done under the old weights (a fork parked for a batch slot
    holding its prompt's pages, or a preempted one with sampled tokens) finishes on those weights
    before the swap: swapping as soon as the running list emptied would have decoded it on the
    new weights over a cache (or tokens) from the old ones, a completion of two versions."""
    cfg, params = tiny
    new_params = rlkjax.init_params(cfg, seed=1)
    if case == "parked-fork":
        engine = Engine(params, cfg, config=ENGINE_4)
        reqs = [  # 5 sequences for 4 slots: a fork waits
            engine.submit([1, 2, 3], max_tokens=12, seed=0),
            engine.submit(list(range(30, 50)), n=4, max_tokens=4, seed=5),
        ]
        while not any(s.pages for s in engine.scheduler.waiting):
            engine.step()
    else:
        engine = Engine(params, cfg, config=ENGINE_TIGHT)
        # 2 x 7 pages of 109 tokens, 11 pages in the cache: one is preempted as they grow
        reqs = [engine.submit(list(range(1, 30)), max_tokens=80, seed=j) for j in range(2)]
        while not any(s.generated for s in engine.scheduler.waiting):
            engine.step()
    engine.update_weights(new_params)
    engine.run_until_done()
    assert engine.policy_version == 1
    for r in reqs:
        for comp in r.results:
            assert comp.policy_version == 0 and len(comp.tokens) == r.sampling.max_tokens
            check_exact(params, cfg, r, comp, 1.0)


@pytest.mark.slow
def test_admission_takes_turns_between_groups(tiny):
    """A group of 12 one-sample requests (one HTTP request's prompts) arrives first, then a lone
    request: with 4 batch slots, the lone one is admitted in the second turn, not after all 12
    (before, a 2-token request waited minutes behind a 256-sequence one). Every result exact."""
    cfg, params = tiny
    engine = Engine(params, cfg, config=ENGINE_4)
    big = [engine.submit([3, i + 1], max_tokens=8, seed=i, group="big") for i in range(12)]
    small = engine.submit([7, 7, 7], max_tokens=2, seed=99)
    while not small.done.is_set():
        engine.step()
    assert sum(r.done.is_set() for r in big) <= 2, "the lone request waited behind the whole group"
    engine.run_until_done()
    for r in big + [small]:
        check_exact(params, cfg, r, r.results[0], 1.0)


def test_a_small_request_takes_the_next_free_slot(tiny):
    """Fair turns, counted in engine steps: a group of 4 prompts x n=4 samples x 16 tokens fills
    all 4 batch slots (its forks wait, holding their prompt's pages) when a 2-token request
    arrives. The small one is admitted in the step after the first slot frees and finishes one
    decode round later (plus the round in flight), long before the group. Before, the group's
    parked forks went first, as sequences already started: the small request waited for 12 of
    the group's 16 sequences. Its tokens and bits are those it draws alone."""
    cfg, params = tiny
    engine = Engine(params, cfg, config=ENGINE_4)
    big = [engine.submit([9, i + 1, 4, 4, 4], n=4, max_tokens=16, seed=i, group="big") for i in range(4)]
    while not any(s.pages for s in engine.scheduler.waiting):  # the forks wait for slots
        engine.step()
    small = engine.submit([7, 7, 7], max_tokens=2, seed=99)
    freed = admitted = done = None
    while engine.busy:
        before = sum(c is not None for r in big for c in r.results)
        engine.step()
        step = engine.stats["steps"]
        if freed is None and sum(c is not None for r in big for c in r.results) > before:
            freed = step  # a big sequence finished at the end of this step: its slot is free
        if admitted is None and any(s.request is small for s in engine.scheduler.running):
            admitted = step
        if done is None and small.done.is_set():
            done = step
    assert freed is not None and admitted == freed + 1, (freed, admitted)
    # prefill in the admitting step, then its one round is dispatched and read a step later
    assert done <= admitted + 2, (admitted, done)
    last_big = engine.stats["steps"]
    assert done < last_big / 2, (done, last_big)
    lone = alone(params, cfg, small.prompt, 2, 1.0, 99)
    assert lone.tokens == small.results[0].tokens
    assert_bits_equal(lone.logprobs, small.results[0].logprobs, "small request, fair turn vs alone")
    for r in big[:1] + [small]:
        for comp in r.results:
            check_exact(params, cfg, r, comp, 1.0)
