"""The rollout engine's warm-up (rlkjax.engine.engine's `Engine` takes these methods): every batch bucket of the
prefill, decode-round and page-copy programs that default traffic runs, loaded from the executable cache or
compiled before the first request, so no request waits behind a compilation. The engine supplies each
shape's call on padding (`_warm_up_call`), its lock, its KV cache (`_ensure_cache`) and `_note_shape`."""

import concurrent.futures
import os
import time

import jax

from rlkjax.core.shapes import bucket, cdiv


class WarmUp:
    def warm_up(self, report=None) -> int:
        """Compile, before any request comes, every shape that default traffic runs: the prefill
        and decode-round batch buckets up to max_batch and the page copies of forks, so no request
        later waits behind a compilation. Each is loaded or compiled into the executable cache where
        one is set, else runs once on padding (position -1 writes only the trash page; a round with no
        budget samples nothing). Variants that options select (top_logprobs,
        top_k / top_p / min_p, more than one stop id) still compile on first use. `report(name,
        shape, seconds)` is called after each. Returns the number of shapes run."""
        shapes = self.warm_up_shapes()
        self.load_warm_up()
        for name, rows in shapes:
            seconds = self.warm_up_shape(name, rows)
            if report:
                report(name, rows, seconds)
        return len(shapes)

    def warm_up_shapes(self) -> list[tuple[str, int]]:
        """What `warm_up` compiles, in order: (program, rows) pairs."""
        c = self.config
        rows = [1 << i for i in range(bucket(c.max_batch).bit_length())]
        prefill_rows = bucket(min(c.max_batch, cdiv(c.token_budget, c.prefill_chunk)))
        decode_rows = [r for r in rows if r >= self.min_decode_rows]
        todo = [("prefill", r) for r in rows if r <= prefill_rows]
        todo += [("decode_round", r) for r in decode_rows] + [("copy_pages", r) for r in rows]
        # both round lengths (see _dispatch_decode): with one decode step per round they are the same
        todo += [("decode_round_1", r) for r in decode_rows] if c.decode_steps > 1 else []
        return todo

    def warm_up_shape(self, name: str, r: int) -> float:
        """Get one of `warm_up_shapes()` ready: load or compile its executable (rlkjax.engine.executable_cache),
        or where that cache is off, compile it by running it on padding; returns the seconds it took.
        One at a time, so a caller (the server) can report progress and stop between shapes."""
        with self.lock:
            start = time.perf_counter()
            self._ensure_cache()
            fn, args, cache_at, seen = self._warm_up_call(name, r)
            if fn.prepare(*args) is None:
                out = fn(*args)
                self.cache = out if cache_at is None else out[cache_at]
            self._note_shape(*seen)
            jax.block_until_ready(self.cache)
            return time.perf_counter() - start

    def load_warm_up(self, threads: int | None = None) -> int:
        """Read the executables of every warm-up shape that the executable cache holds on disk, several
        at once, so that `warm_up_shape` finds them in memory (one after another they took seconds of CPU:
        bench/results/2026-12-03_h200_cpu_measurements_behind_defaults.md). Shapes with nothing stored are
        left to `warm_up_shape` to compile. Returns how many were loaded (0 where the cache is off)."""
        with self.lock:
            self._ensure_cache()
            calls = [self._warm_up_call(name, r)[:2] for name, r in self.warm_up_shapes()]
        workers = threads or min(len(calls), os.cpu_count() or 1) or 1
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="load-executable") as pool:
            return sum(pool.map(lambda call: call[0].load(*call[1]), calls))
