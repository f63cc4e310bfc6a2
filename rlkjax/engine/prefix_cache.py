"""The prefix cache: KV pages of sequences that left (finished, cancelled, preempted) stay addressable by
the tokens they hold, so a request that extends a cached prefix (an episode's next turn, a chat client's
next message, the same prompt sampled again) takes those pages and prefills only the rest.

Keys. Page i of a sequence holds positions [16 i, 16 i + 16); its key is a chain hash of every token of
pages 0 ... i, key_i = blake2b(key_{i-1} + tokens of page i) (vLLM's block hashing), so a key names the
whole prefix, not the page's 16 tokens alone. A 128-bit digest: two prefixes share a key with a chance
near 2^-128 per pair, against the bits the contract promises. Only full pages whose every position's K/V
is written are kept; a key already held by another page keeps that page (the duplicate is freed).

Pages. A kept page no sequence holds (reference count 0) is evictable and counts as free: `alloc` takes
never-kept free pages first, then evicts kept ones least recently released first. A sequence's pages are
released last page first, so a chain loses its tail before its head (a lookup stops at the first miss).
A page a sequence holds is never evicted. The index is emptied (`forget`) when the weights change or the
KV arrays are released, since a page's K/V is then stale or gone.

Bits. A page's K/V depends only on the weights and the tokens at and before its positions: the model
writes the cache before attention reads it, and visits KV in position-aligned blocks in a fixed order,
so a prefix taken from the cache gives the logprobs and tokens that prefilling it gives.
"""

import hashlib
from collections import OrderedDict

import numpy as np

from rlkjax.core.numerics import PAGE_SIZE
from rlkjax.engine.records import PageAllocator


def page_keys(tokens, pages: int):
    """The chain keys of the first `pages` full pages of `tokens`, lazily (a lookup stops at its first miss)."""
    data, key = np.asarray(tokens[: pages * PAGE_SIZE], np.int64).tobytes(), b""
    step = PAGE_SIZE * 8
    for i in range(pages):
        key = hashlib.blake2b(key + data[i * step : (i + 1) * step], digest_size=16).digest()
        yield key


class PrefixCache(PageAllocator):
    """The page allocator with the prefix index: reference counts, the free list, and kept pages by key."""

    def __init__(self, num_pages: int):
        super().__init__(num_pages)
        self.index: dict[bytes, int] = {}  # key -> page
        self.key_of: dict[int, bytes] = {}  # page -> key
        self.evictable: OrderedDict[int, None] = OrderedDict()  # kept pages with no reference, oldest first
        # lookups: sequences admitted after a lookup; hits: those that found a page; query_tokens: the
        # positions they would prefill without the cache; hit_tokens: those the cache held (prefill saved)
        self.stats = dict(lookups=0, hits=0, query_tokens=0, hit_tokens=0, evictions=0)

    @property
    def available(self) -> int:
        return len(self.free) + len(self.evictable)

    def alloc(self, n: int) -> list[int] | None:
        if n > self.available:
            return None
        pages = []
        for _ in range(n):
            if self.free:
                pages.append(self.free.popleft())
                continue
            page, _ = self.evictable.popitem(last=False)
            del self.index[self.key_of.pop(page)]
            self.stats["evictions"] += 1
            pages.append(page)
        self.refs[pages] = 1
        return pages

    def share(self, pages):
        for p in pages:
            self.evictable.pop(p, None)
        super().share(pages)

    def release(self, pages):
        for p in reversed(pages):  # the tail becomes the least recently used: evicted first
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if p in self.key_of:
                    self.evictable[p] = None
                else:
                    self.free.append(p)

    def lookup(self, tokens, pages: int) -> list[int]:
        """The kept pages that hold the first full pages of `tokens`, at most `pages`, up to the first miss."""
        hits = []
        for key in page_keys(tokens, pages):
            page = self.index.get(key)
            if page is None:
                break
            hits.append(page)
        return hits

    def take(self, tokens, n: int) -> tuple[list[int], int] | None:
        """n pages for a sequence of `tokens` that holds none: the kept ones holding its prefix, then new
        ones; and the positions the kept ones hold. The last token is never taken from the cache: the
        first decode step feeds it, whose logits sample the next token, so a prompt that is all full kept
        pages recomputes its last page (a page is never written by two sequences). None (nothing taken)
        if the pages do not last."""
        hits = self.lookup(tokens, (len(tokens) - 1) // PAGE_SIZE)
        if n - len(hits) > self.available - sum(p in self.evictable for p in hits):
            return None
        self.share(hits)
        pages = hits + self.alloc(n - len(hits))
        cached = len(hits) * PAGE_SIZE
        self.stats["lookups"] += 1
        self.stats["hits"] += bool(hits)
        self.stats["query_tokens"] += len(tokens) - 1
        self.stats["hit_tokens"] += cached
        return pages, cached

    def keep(self, tokens, pages: list[int], written: int):
        """Index a leaving sequence's full pages whose K/V is written (positions [0, written))."""
        for key, page in zip(page_keys(tokens, written // PAGE_SIZE), pages):
            if key not in self.index and page not in self.key_of:
                self.index[key], self.key_of[page] = page, key

    def forget(self):
        """Empty the index (new weights, or the KV arrays released): kept pages no one holds are free."""
        self.free.extend(self.evictable)
        self.index.clear()
        self.key_of.clear()
        self.evictable.clear()

    def reset(self):
        self.forget()
        super().reset()


def metrics(pages: PageAllocator) -> dict:
    """The prefix cache's counters for Engine.metrics (zeros where the cache is off)."""
    stats = getattr(pages, "stats", dict(lookups=0, hits=0, query_tokens=0, hit_tokens=0, evictions=0))
    out = {f"prefix_cache_{name}": value for name, value in stats.items()}
    out["prefix_cache_hit_rate"] = stats["hit_tokens"] / stats["query_tokens"] if stats["query_tokens"] else 0.0
    out["prefix_cache_pages"] = len(getattr(pages, "index", ()))
    return out
