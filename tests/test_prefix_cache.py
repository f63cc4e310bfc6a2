"""The prefix cache (rlkjax.engine.prefix_cache): a request's logprobs and tokens are the same bits whether its
prefix came from the cache or from prefill (an episode's second turn, the same prompt sampled again, a
cancelled sample's tokens continued), and the page bookkeeping under it: least recently used eviction,
tail pages first, held pages never evicted, the index emptied when the weights or the KV arrays go, and
no page kept when the cache is off."""

import dataclasses

import pytest

import rlkjax
from rlkjax.core.numerics import PAGE_SIZE
from rlkjax.engine.engine import Engine
from rlkjax.engine.prefix_cache import PrefixCache, page_keys
from rlkjax.engine.records import PageAllocator
from tests.helpers import ENGINE, assert_bits_equal

COLD = dataclasses.replace(ENGINE, prefix_cache=False)  # the same programs: the switch is host-side only


def hits(engine) -> int:
    return engine.metrics()["prefix_cache_hit_tokens"]


def check_exact(params, cfg, prompt, completion, what):
    scored = rlkjax.score(params, cfg, [prompt + completion.tokens], [len(prompt)])[0]
    assert_bits_equal(completion.logprobs, scored, f"{what}: score vs sampled")


def assert_same(a, b, what):
    assert a.tokens == b.tokens, f"{what}: tokens differ"
    assert_bits_equal(a.logprobs, b.logprobs, what)


def test_second_turn_from_the_cache_equals_a_cold_prefill(tiny):
    """Turn 2's prompt is turn 1's prompt + completion + 10 new tokens (an episode's next turn, a chat
    client's next message): with the cache warm it takes 2 pages (positions 0-31, of which 19-31 decode
    steps wrote, not prefill) and prefills 11 positions; a cold engine prefills all 43. Same tokens,
    same logprob bits, both equal to `score` of the whole sequence. The cold engine keeps no page."""
    cfg, params = tiny
    warm, cold = Engine(params, cfg, config=ENGINE), Engine(params, cfg, config=COLD)
    first = list(range(100, 120))
    turn1 = warm.submit(first, max_tokens=14, seed=3)
    warm.run_until_done()
    assert warm.metrics()["prefix_cache_pages"] == 2 and warm.pages.used == 0  # 33 positions written
    second = first + turn1.results[0].tokens + list(range(7, 17))
    before = warm.metrics()["prefill_tokens"]
    turn2 = warm.submit(second, max_tokens=10, seed=4)
    warm.run_until_done()
    assert hits(warm) == 2 * PAGE_SIZE and warm.metrics()["prefill_tokens"] - before == len(second) - 1 - 32
    alone = cold.submit(second, max_tokens=10, seed=4)
    cold.run_until_done()
    assert hits(cold) == 0 and cold.metrics()["prefill_tokens"] == len(second) - 1
    assert_same(turn2.results[0], alone.results[0], "second turn: cache vs prefill")
    check_exact(params, cfg, second, turn2.results[0], "second turn")
    assert cold.metrics()["prefix_cache_pages"] == 0 and cold.pages.available == ENGINE.num_pages - 1
    assert warm.pages.used == 0 and warm.pages.available == ENGINE.num_pages - 1  # kept pages count as free


def test_same_prompt_twice_hits_the_cache_and_forks_at_admission(tiny):
    """A 33-token prompt, n=2, sampled twice with one seed: the second time its 32 prefilled positions
    are both full pages of the cache, so nothing is prefilled and the leader forks at admission (a
    leader that forked only after a prefill chunk would have left its samples waiting forever).
    Identical results, each sample's logprobs equal to `score`."""
    cfg, params = tiny
    engine = Engine(params, cfg, config=ENGINE)
    prompt = list(range(40, 73))
    first = engine.submit(prompt, n=2, max_tokens=5, seed=8)
    engine.run_until_done()
    prefilled = engine.metrics()["prefill_tokens"]
    again = engine.submit(prompt, n=2, max_tokens=5, seed=8)
    engine.run_until_done()
    m = engine.metrics()
    assert m["prefill_tokens"] == prefilled and hits(engine) == 32 and m["prefix_cache_hits"] == 1
    assert m["prefix_cache_hit_rate"] == 32 / (2 * 32)  # the first request looked up 32 positions too
    for j in range(2):
        assert_same(first.results[j], again.results[j], f"sample {j}: second time vs first")
        check_exact(params, cfg, prompt, again.results[j], f"sample {j}")
    assert first.results[0].tokens != first.results[1].tokens
    assert engine.pages.used == 0


def test_a_cancelled_sample_s_pages_continue_exactly(tiny):
    """A sample cancelled mid-decode (a round in flight: it writes positions past the kept ones) keeps
    its written full pages; a request continuing its tokens takes them and samples what `score` gives."""
    cfg, params = tiny
    engine = Engine(params, cfg, config=ENGINE)
    prompt = list(range(1, 12))
    long = engine.submit(prompt, max_tokens=200, seed=2)
    while engine.stats["decode_tokens"] < 40:
        engine.step()
    engine.cancel(long)
    engine.run_until_done()
    partial = long.results[0]
    assert partial.finish_reason == "cancelled" and len(partial.tokens) >= 40
    written = len(prompt) + len(partial.tokens) - 1
    assert engine.metrics()["prefix_cache_pages"] == written // PAGE_SIZE
    seq = prompt + partial.tokens + [5, 6, 7]
    cont = engine.submit(seq, max_tokens=4, seed=9)
    engine.run_until_done()
    assert hits(engine) == (len(seq) - 1) // PAGE_SIZE * PAGE_SIZE
    check_exact(params, cfg, seq, cont.results[0], "continued after a cancel")


def test_new_weights_and_a_released_cache_empty_the_index(tiny):
    """Cached K/V belongs to the weights that wrote it and lives in the arrays release_cache frees
    (train.grpo between rollouts): after a weight swap, and after release_cache, nothing is kept and
    the same request prefills again, with the bits it had before the release."""
    cfg, params = tiny
    engine = Engine(params, cfg, config=ENGINE)
    prompt = list(range(60, 100))
    first = engine.submit(prompt, max_tokens=3, seed=1)
    engine.run_until_done()
    assert engine.metrics()["prefix_cache_pages"] == 2
    engine.release_cache()
    assert engine.metrics()["prefix_cache_pages"] == 0
    again = engine.submit(prompt, max_tokens=3, seed=1)
    engine.run_until_done()
    assert hits(engine) == 0 and engine.metrics()["prefix_cache_pages"] == 2
    assert_same(first.results[0], again.results[0], "after release_cache")
    engine.update_weights(params)
    engine.step()
    assert engine.policy_version == 1 and engine.metrics()["prefix_cache_pages"] == 0
    assert engine.pages.available == ENGINE.num_pages - 1


# ----- the page bookkeeping, on the host alone -----


def tokens(n, start=0):
    return list(range(start, start + n))


def test_pages_are_evicted_least_recently_released_first_tail_first():
    """Free pages go first; then kept pages in the order they were released, a sequence's last page
    before its first (a lookup stops at the first miss, so a chain's head is worth more)."""
    cache = PrefixCache(8)  # pages 1-7
    a, b = cache.alloc(3), cache.alloc(2)
    seq_a, seq_b = tokens(48), tokens(32, start=500)
    for seq, pages in ((seq_a, a), (seq_b, b)):
        cache.keep(seq, pages, len(seq))
        cache.release(pages)
    assert cache.available == 7 and len(cache.free) == 2 and len(cache.index) == 5
    assert cache.alloc(2) == [6, 7]  # the never-kept free pages
    assert cache.alloc(1) == [a[2]] and cache.lookup(seq_a, 3) == a[:2]  # a's tail went first
    assert cache.alloc(3) == [a[1], a[0], b[1]] and cache.lookup(seq_b, 2) == b[:1]
    assert cache.stats["evictions"] == 4 and cache.alloc(2) is None and cache.alloc(1) == [b[0]]


def test_a_held_page_is_never_evicted_and_a_hit_is_recently_used():
    """A kept page a sequence holds (taken by a hit) is not evictable however old; released again it
    is the most recently used. `take` refuses (taking nothing) when the new pages do not last, counting
    the evictable pages it would hit as not free, and never takes the last token's page."""
    cache = PrefixCache(6)  # pages 1-5
    old, new = tokens(32), tokens(32, start=100)
    for seq in (old, new):  # old's pages [1, 2], then new's [3, 4]; page 5 free
        pages = cache.alloc(2)
        cache.keep(seq, pages, 32)
        cache.release(pages)
    got, cached = cache.take(old + [9], 3)  # both of old's pages, and one new page
    assert cached == 32 and got == [1, 2, 5] and cache.available == 2
    assert cache.take(tokens(80, start=300), 5) is None and cache.available == 2  # nothing taken
    assert cache.alloc(3) is None and cache.stats["evictions"] == 0  # held pages stay
    cache.release(got)
    assert cache.alloc(3) == [5, 4, 3]  # new's pages, tail first: old's were used since
    assert cache.lookup(old, 2) == [1, 2] and cache.lookup(new, 2) == []
    assert cache.take(old, 2) == ([1, 2], PAGE_SIZE)  # 32 tokens: page 1 recomputes position 31 (evicted, reused)
    s = cache.stats
    assert (s["lookups"], s["hits"], s["query_tokens"], s["hit_tokens"]) == (2, 2, 32 + 31, 32 + 16)


def test_keys_name_the_whole_prefix_and_duplicates_are_freed():
    """A page's key covers every token before it: the same 16 tokens after another first page are
    another key. A second page holding a kept prefix is freed, not kept (one page per key). forget()
    and reset() empty the index; the allocator without the cache keeps nothing."""
    first, other = tokens(32), tokens(16, start=900) + tokens(16, start=16)
    assert list(page_keys(first, 2))[1] != list(page_keys(other, 2))[1]
    assert list(page_keys(first, 2)) == list(page_keys(first + [1, 2], 2))
    cache = PrefixCache(6)
    a, b = cache.alloc(2), cache.alloc(2)
    for pages in (a, b):
        cache.keep(first, pages, 32)
        cache.release(pages)
    assert cache.lookup(first, 2) == a and len(cache.free) == 1 + 2 and len(cache.evictable) == 2
    held = cache.take(first + [0], 3)[0]
    cache.forget()
    assert cache.lookup(first, 2) == [] and cache.available == 5 - 3
    cache.release(held)
    assert cache.available == 5 and not cache.evictable
    cache.keep(first, cache.alloc(2), 32)
    cache.reset()
    assert cache.available == 5 and not cache.index and cache.refs.sum() == 0
    plain = PageAllocator(6)
    pages, cached = plain.take(first + [0], 3)
    plain.keep(first + [0], pages, 32)
    plain.release(pages)
    assert cached == 0 and len(plain.free) == 5 and plain.take(first + [0], 3)[1] == 0


@pytest.mark.parametrize("flag", ["--no-prefix-cache", "--prefix-cache"])
def test_server_flag_switches_the_cache(flag):
    import tyro

    from serve.config import ServerConfig

    config = tyro.cli(ServerConfig, args=[flag])
    assert config.engine.prefix_cache == (flag == "--prefix-cache")
