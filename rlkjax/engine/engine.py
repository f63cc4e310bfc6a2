"""Continuous-batching rollout engine over the paged KV cache.

Each engine step (a) admits waiting requests while pages and batch slots last, (b) runs one prefill
call over up to `token_budget` prompt tokens (chunks of `prefill_chunk` per sequence), and (c) one
decode call over every sequence whose prefix is cached, sampling its next token. Requests join and
leave between steps. The n samples of a request share its prompt's KV pages: one leader prefills,
the others fork from it, sharing every full page and copying the partial last one (copy-on-write).
When pages run out, a sequence is preempted (its pages freed) and recomputed later. Who gets a
batch slot, a page or a row, and who is preempted, is rlkjax.engine.scheduler's policy (fair turns). A
request extending the tokens of ended sequences takes their full pages (rlkjax.engine.prefix_cache).

Every call goes through the one model function, so in strict mode a completion's logprobs equal
`rlkjax.score` of the finished sequence bit for bit, however it was scheduled, shared or
preempted, and a request's tokens depend only on its prompt, seed and temperature.

Shapes (compiled once per bucket): prefill tokens [B, prefill_chunk], decode tokens [B, 1], page
table [B, pages_per_seq]; B is a power of two up to max_batch, and for decode at least the rows the
strict forward carries anyway (`min_decode_rows`).

The device programs are rlkjax.engine.programs', the request and sequence records rlkjax.engine.records', the
scheduling policy (admission in fair turns, pages, preemption, forks, each call's rows)
rlkjax.engine.scheduler's, the settings rlkjax.engine.config's, the warm-up (`warm_up`) rlkjax.engine.warm_up's.
The public surface for a server or a learner: `submit`, `cancel`, `stop`, `update_weights`, `step`,
`run_until_done`, `abort`, and the read-only `busy`, `weights_pending`, `policy_version` and `metrics()`.
The engine's one way out is each request's output queue (rlkjax.engine.outputs): each round's new tokens
where its caller follows them, then its end; it calls no caller code. Its callers' ways in (`submit`,
`cancel`, `stop`, `update_weights`) only queue what the next step applies, so a request's record is
written on the engine's thread alone.

Every submitted request ends exactly once, counted in one of three outcomes: finished (every sample
stopped or reached its length), cancelled (`cancel`: a client gone, a timeout, a shutdown), failed
(`abort` after a step raised). At rest, requests == finished + cancelled + failed.
"""

import dataclasses
import itertools
import threading
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from rlkjax.core.checks import check_int, check_tokens, most_top_logprobs, sample_seed
from rlkjax.core.config import ModelConfig
from rlkjax.core.model import init_kv_cache, rope_tables
from rlkjax.core.numerics import PAGE_SIZE, Numerics, ops, padded_rows
from rlkjax.core.sampling_params import SamplingParams
from rlkjax.core.shapes import bucket, cdiv
from rlkjax.engine import executable_cache, prefix_cache, programs
from rlkjax.engine.config import EngineConfig
from rlkjax.engine.outputs import OutputQueue
from rlkjax.engine.programs import Decoding, RoundStart, RowSampling
from rlkjax.engine.records import EngineRequest, Round, Sequence, round_rows
from rlkjax.engine.scheduler import Scheduler
from rlkjax.engine.warm_up import WarmUp

# The programs, through the executable cache where compilation_cache.enable() set one (a restarted
# server loads them instead of tracing, lowering and compiling again), else through jax.jit alone.
prefill_chunk = executable_cache.cached(programs.prefill_chunk, "cfg", "numerics")
next_round = executable_cache.cached(programs.next_round, "decoding")
copy_pages = executable_cache.cached(programs.copy_pages)


class Engine(WarmUp):
    def __init__(
        self,
        params,
        cfg: ModelConfig,
        numerics: Numerics = "strict",
        config: EngineConfig | None = None,
        eos_token_id: int | None = None,
    ):
        """config: the scheduling settings (None: EngineConfig's defaults). eos_token_id: the model's
        end-of-sequence id, a stop id of every request that does not ask for ignore_eos (None: no
        implicit stop)."""
        config = config or EngineConfig()
        ops(numerics)  # validates the mode before any work
        if eos_token_id is not None:
            check_int("eos_token_id", eos_token_id, 0, cfg.vocab_size - 1)
        self.cfg, self.numerics, self.config, self.eos_token_id = cfg, numerics, config, eos_token_id
        self.max_context = min(config.max_context or cfg.max_position, cfg.max_position)
        self.pages_per_seq = bucket(cdiv(self.max_context, PAGE_SIZE))
        self.params, self.policy_version = params, 0
        self.cache = init_kv_cache(cfg, config.num_pages)
        weight = jax.tree.leaves(params)[0]
        if getattr(weight, "committed", False) and len(weight.sharding.device_set) == 1:
            # Weights committed to a device (train.grpo's samplers) make every step's cache output
            # committed there too: so is the first cache, or the first prefill call would lower (and
            # compile) a second program, one for an uncommitted cache.
            (device,) = weight.sharding.device_set
            self.cache = jax.device_put(self.cache, device)
        self.rope = rope_tables(cfg)
        # Decode rounds run at least the rows the strict forward carries anyway (numerics.padded_rows: one
        # decode tile, 16 rows on CUDA, 32 on ROCm): a round of 1, 2, 4 or 8 rows computes that many in
        # every matmul and norm, so its own bucket would only cost a compilation (each server start,
        # each generate call) and save no device time.
        self.min_decode_rows = min(bucket(config.max_batch), padded_rows(1, numerics))
        self._top_logprobs = most_top_logprobs(cfg.vocab_size)
        self.scheduler = Scheduler(config)
        self.requests: dict[int, EngineRequest] = {}
        self._ids = itertools.count()
        self._pending_params, self._swap_events = None, []
        self.lock = threading.RLock()  # held by step(); submit, cancel, update_weights and metrics never wait on it
        self._inbox: deque = deque()  # submitted (request, sequences), moved to `waiting` at the next step
        self._cancels: deque = deque()  # (request, sample index or None: all), applied at the next step
        self._mailbox = threading.Lock()  # guards the pending weights and their events
        self.shapes_seen: set = set()  # (program, batch bucket): one compilation each
        self.stats = {
            "steps": 0,
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "requests": 0,  # submitted; each ends once, in one of the next three
            "finished": 0,
            "cancelled": 0,
            "failed": 0,
            # Seconds inside step(), and of those, blocked reading a decode round (the device still
            # busy). step_s - wait_s is host work the device may sit idle through.
            "step_s": 0.0,
            "wait_s": 0.0,
            # Host seconds from reading one decode round to dispatching the next (the device has no
            # decode work queued then: it idles unless a prefill is), and seconds inside the jitted
            # calls' dispatch (asynchronous: near zero unless a dispatch waits on the device).
            "gap_s": 0.0,
            "dispatch_s": 0.0,
            "chained_rows": 0,  # decode rows dispatched before the round they continue was read
            # Decode rounds and their rows (sequences decoding together; one round a step at most):
            # rows / rounds is the mean concurrency the KV pages and batch slots admitted.
            "decode_rounds": 0,
            "decode_rows": 0,
        }
        self._round_read_at = None  # when the last decode round was read, until the next is dispatched
        # The decode round on the device, not read yet: the next round is dispatched before it is read
        # (its rows continue on the device), so the host's reading and scheduling overlap the device's work.
        self._in_flight: Round | None = None
        rows = bucket(config.max_batch)
        self._no_carry = (jnp.zeros(rows, jnp.int32), jnp.ones(rows, bool))

    # ----- requests -----
    def submit(
        self,
        prompt,
        sampling: SamplingParams | None = None,
        *,
        group=None,
        outputs: OutputQueue | None = None,
        **fields,
    ) -> EngineRequest:
        """Validate and queue a request; raises ValueError naming the bad field.

        `sampling` holds the request's options (SamplingParams(), the defaults, if None); keyword
        `fields` replace some of them (`submit(p, n=4, seed=1)`). A sample stops at max_tokens, or at
        a stop id (stop_token_ids, and the engine's eos_token_id unless ignore_eos) once it has
        min_tokens tokens. Requests with the same `group` (e.g. the prompts of one HTTP request)
        count as one in admission's fair turns. `outputs`: where the request's outputs go (an OutputQueue that
        follows rounds gets each round's new tokens, every queue the request's end; several requests may share
        one); None: a queue of its own that gets only the end, `request.outputs`."""
        sampling = sampling or SamplingParams()
        if fields:
            sampling = dataclasses.replace(sampling, **fields)
        prompt = check_tokens("prompt", prompt, self.cfg.vocab_size)
        check_int("n", sampling.n, 1, self.config.max_batch)
        sampling.check_model(self.cfg.vocab_size, self.max_context, len(prompt))
        self.check_pages(len(prompt), sampling.max_tokens)
        stop_ids = sampling.stop_ids(self.eos_token_id)
        req = EngineRequest(next(self._ids), prompt, sampling, stop_ids, outputs=outputs or OutputQueue())
        req.group = ("request", req.id) if group is None else group
        req.results = [None] * sampling.n
        seed = sampling.seed
        if sampling.n > 1 and len(req.prompt) > 1:
            req.pending_forks = sampling.n - 1  # they fork from the leader once its prompt is cached
            seqs = [Sequence(req, 0, seed, list(req.prompt))]
        else:
            seqs = [Sequence(req, j, sample_seed(seed, j), list(req.prompt)) for j in range(sampling.n)]
        self._inbox.append((req, seqs))  # deque.append is thread-safe: no waiting for a step to end
        self.stats["requests"] += 1
        return req

    def check_pages(self, prompt_len: int, max_tokens: int, field: str = "max_tokens") -> None:
        """ValueError unless a sequence of prompt_len + max_tokens tokens fits the KV cache (`field`: the
        caller's name for max_tokens)."""
        if cdiv(prompt_len + max_tokens, PAGE_SIZE) > self.config.num_pages - 1:
            raise ValueError(f"prompt + {field} needs more KV pages than the cache holds ({self.config.num_pages - 1})")

    def cancel(self, request: EngineRequest):
        """Cancel a request (from any thread); its sequences and pages are released at the next step."""
        self._cancels.append((request, None))  # deque.append is thread-safe; the step writes the record

    def stop(self, request: EngineRequest, index: int):
        """End sample `index` of `request` at the next step (from any thread), finish reason "stop": its caller
        found a stop string in its text. Its completion keeps every token sampled until then (the caller cuts
        the text where the stop string ends it); the request's other samples go on."""
        check_int("index", index, 0, request.sampling.n - 1)
        self._cancels.append((request, index))

    def update_weights(self, params) -> threading.Event:
        """Swap weights between steps, once no sequence is in flight (no completion mixes versions).
        Admission pauses until then. The returned event is set when the new version is live. Calls
        before the swap all complete at that swap; the last call's weights are the ones served."""
        with self._mailbox:  # held for two assignments, never across a step
            event = threading.Event()
            self._pending_params = params
            self._swap_events.append(event)
            return event

    def _warm_up_call(self, name: str, r: int):
        """One of `warm_up_shapes()` as a call on padding: (program, its positional arguments,
        where its outputs hold the new KV cache (None: the whole output), the shape it notes as seen).
        Position -1 writes only the trash page; a round with no budget samples nothing."""
        c = self.config
        table = np.zeros((r, self.pages_per_seq), np.int32)
        zeros = np.zeros(r, np.int32)
        if name == "prefill":
            tokens, positions = np.zeros((r, c.prefill_chunk), np.int32), np.full((r, c.prefill_chunk), -1, np.int32)
            args = (self.params, tokens, positions, self.cache, table, self.rope, self.cfg, self.numerics)
            return prefill_chunk, args, None, (name, r)
        if name.startswith("decode_round"):
            length = 1 if name == "decode_round_1" else c.decode_steps
            idle = np.full(r, -1, np.int32)  # no row continues a round; every position is padding
            args = self._round_args(
                RoundStart(self._no_carry, idle, zeros), idle, table, RowSampling.idle(r), length, 0
            )
            return next_round, args, 2, ("decode_round", (r, 1, 0, False, length))
        return copy_pages, (self.cache, zeros, zeros), None, (name, r)

    def release_cache(self) -> None:
        """Free the KV cache's device memory while no request is in flight, for a learner that shares
        the device (train.grpo between rollouts: the learner's step needs that memory). The next step
        allocates zeroed pages in its place; a finished sequence has released its pages, so no request
        loses any (the prefix cache forgets)."""
        with self.lock:
            if self.busy or self.weights_pending:
                raise RuntimeError("release_cache() while requests are in flight: their KV pages would be lost")
            if self.cache is not None:
                self._released = [(x.shape, x.dtype, x.sharding) for x in self.cache]
                self.cache = None
            self.pages.forget()  # the cached prefixes' K/V goes with the arrays

    def release_weights(self) -> None:
        """Free the weights' device memory while no request is in flight, for a learner that shares the device
        (train.grpo on one GPU: the learner's step needs that memory). update_weights must give the
        next weights before the next request runs."""
        with self.lock:
            if self.busy or self.weights_pending:
                raise RuntimeError("release_weights() while requests are in flight or weights are pending")
            self.params = None

    def _ensure_cache(self):
        if self.cache is None:
            self.cache = tuple(jnp.zeros(shape, dtype, device=at) for shape, dtype, at in self._released)

    @property
    def busy(self) -> bool:
        """Requests are queued, sequences waiting or running, or a decode round not read yet."""
        return bool(self._inbox or self.scheduler.busy or self._in_flight)

    @property
    def pages(self):
        """The KV page allocator (the scheduler's), for callers that count the pages in use."""
        return self.scheduler.pages

    @property
    def weights_pending(self) -> bool:
        """A weight update waits for the in-flight sequences to finish."""
        return self._pending_params is not None

    # ----- the step -----
    def step(self) -> list[EngineRequest]:
        """One scheduling step. Returns the requests that finished in it."""
        start = time.perf_counter()
        with self.lock:
            self._ensure_cache()
            while self._inbox:
                req, seqs = self._inbox.popleft()
                req.take()
                self.requests[req.id] = req
                self.scheduler.waiting.extend(seqs)
            finished = self._apply_cancels() + self._reap_cancelled()
            # preempted or parked sequences too, and a round not read yet (its rows may have finished)
            in_flight = self.scheduler.started or self._in_flight
            with self._mailbox:
                if self._pending_params is not None and not in_flight:
                    self.params, self._pending_params = self._pending_params, None
                    self.policy_version += 1
                    self.pages.forget()  # the cached prefixes' K/V is the old weights'
                    for event in self._swap_events:
                        event.set()
                    self._swap_events = []
            if self.params is None:
                raise RuntimeError("the engine's weights were released: update_weights() must give new ones first")
            self.scheduler.admit(fresh=self._pending_params is None)
            self._fork_ready(list(self.scheduler.running))  # a leader whose whole prompt was cached
            # Dispatch this step's decode round before reading the one in flight: its rows continue
            # on the device, and the host reads the last round, plans and dispatches the prefill
            # while the device decodes (JAX runs them asynchronously, in order).
            previous, self._in_flight = self._in_flight, None
            if previous and not self.scheduler.pages_ahead(previous):
                # Growing the sequences would preempt one: read the round first (nothing in flight then).
                finished += self._collect_decode(previous)
                previous = None
            self._in_flight = self._dispatch_decode(previous)
            if self._in_flight is None:
                self._round_read_at = None  # no round follows: not a gap between rounds
            prefilling = self.scheduler.prefill_rows()
            if prefilling:
                self._prefill(prefilling)
            if previous:
                finished += self._collect_decode(previous)
            self.stats["steps"] += 1
            self.stats["step_s"] += time.perf_counter() - start
            return finished

    def run_until_done(self) -> None:
        while self.busy or self.weights_pending:
            self.step()

    def _page_table(self, seqs, rows):
        table = np.zeros((rows, self.pages_per_seq), np.int32)
        for i, s in enumerate(seqs):
            table[i, : len(s.pages)] = s.pages
        return table

    def _note_shape(self, name, rows):
        self.shapes_seen.add((name, rows))

    def _prefill(self, batch):
        """One prefill call: the next chunk of each sequence's prompt (all but its last token, which
        the first decode step feeds); a leader whose prompt is then cached forks its samples."""
        chunk = self.config.prefill_chunk
        rows = bucket(len(batch))
        tokens = np.zeros((rows, chunk), np.int32)
        positions = np.full((rows, chunk), -1, np.int32)
        for i, s in enumerate(batch):
            todo = min(chunk, len(s.tokens) - 1 - s.cached)
            tokens[i, :todo] = s.tokens[s.cached : s.cached + todo]
            positions[i, :todo] = np.arange(s.cached, s.cached + todo)
        self._note_shape("prefill", rows)
        table, cfg = self._page_table(batch, rows), self.cfg
        start = time.perf_counter()
        self.cache = prefill_chunk(self.params, tokens, positions, self.cache, table, self.rope, cfg, self.numerics)
        self.stats["dispatch_s"] += time.perf_counter() - start
        for i, s in enumerate(batch):
            todo = int((positions[i] >= 0).sum())
            s.cached += todo
            self.stats["prefill_tokens"] += todo
        self._fork_ready(batch)

    def _fork_ready(self, seqs):
        """Fork the samples of every leader in `seqs` whose prompt is cached (before its first decode)."""
        for s in seqs:
            if s.decoding and s.request.pending_forks and s.index == 0:
                self._copy_pages(*self.scheduler.fork(s))

    def _copy_pages(self, src, dst):
        if src:
            k = bucket(len(src))  # pad with trash-page self copies so the shape is bucketed
            src_a = np.array(src + [0] * (k - len(src)), np.int32)
            dst_a = np.array(dst + [0] * (k - len(dst)), np.int32)
            self._note_shape("copy_pages", k)
            self.cache = copy_pages(self.cache, src_a, dst_a)

    def _round_args(self, start: RoundStart, positions, table, sampling, length, top_logprobs) -> tuple:
        """programs.next_round's arguments, all positional (warm-up and rounds alike: jit keys positional
        and keyword arguments apart, so both pass the same way); a round of `length` steps."""
        decoding = Decoding(self.cfg, self.numerics, length, top_logprobs)
        return self.params, start, positions, self.cache, table, sampling, self.rope, decoding

    def _next_round(self, *args):
        """The one call of programs.next_round (arguments as `_round_args`'); returns its outputs but the
        cache, kept here."""
        out_tok, out_lp, self.cache, carry, *top = next_round(*self._round_args(*args))
        return out_tok, out_lp, carry, *top

    def _dispatch_decode(self, previous: Round | None) -> Round | None:
        """Start one decode round (up to `decode_steps` tokens per sequence) on the device over the
        rows the scheduler picks; rows in `previous` (dispatched, not read) continue where it ends."""
        seqs, ahead, budget = self.scheduler.round_rows(previous)
        if not seqs:
            return None
        rows = bucket(len(seqs), self.min_decode_rows)
        tokens, positions, sampling = round_rows(seqs, ahead, budget, rows, self.cfg.vocab_size)
        row_of = {s: j for j, s in enumerate(previous.seqs)} if previous else {}
        src = np.full(rows, -1, np.int32)
        src[: len(seqs)] = [row_of.get(s, -1) for s in seqs]
        self.stats["chained_rows"] += int((src >= 0).sum())
        self.stats["decode_rounds"] += 1
        self.stats["decode_rows"] += len(seqs)
        # One variant with top logprobs (k = the most any request may ask, so every k shares one
        # compilation), used only by rounds where some row asked: the default round keeps its speed.
        top_logprobs = self._top_logprobs if any(s.request.sampling.top_logprobs for s in seqs) else 0
        # A round runs all its steps (decode_round), so when no row may sample more than one token
        # (max_tokens=1 requests, last tokens) it is a one-step round, not decode_steps steps of padding.
        length = 1 if int(sampling.budget.max()) == 1 else self.config.decode_steps
        truncates = sampling.truncation is not None
        self._note_shape("decode_round", (rows, sampling.stop_ids.shape[1], top_logprobs, truncates, length))
        start = time.perf_counter()
        if self._round_read_at is not None and previous is None:
            self.stats["gap_s"] += start - self._round_read_at
        carry = previous.carry if previous else self._no_carry
        table = self._page_table(seqs, rows)
        first = RoundStart(carry, src, tokens)
        out_tok, out_lp, carry, *top = self._next_round(first, positions, table, sampling, length, top_logprobs)
        self.stats["dispatch_s"] += time.perf_counter() - start
        self._round_read_at = None
        return Round(seqs, [budget[s] for s in seqs], (out_tok, out_lp, *top), carry)

    def _collect_decode(self, round_: Round) -> list[EngineRequest]:
        """Read a round's tokens (this waits for the device) and finish the sequences that stopped.
        A sequence that finished while the round was in flight (a stop the host found in the round
        before: the caller's stop, cancellation) is skipped: what the round sampled for it is dropped. Each
        sample's new tokens go onto its request's queue where that follows rounds."""
        start = time.perf_counter()
        out_tok, out_lp, *top = (np.asarray(a) for a in round_.out)
        top_ids, top_lp = top if top else (None, None)
        self._round_read_at = time.perf_counter()
        self.stats["wait_s"] += self._round_read_at - start
        finished = []
        for i, s in enumerate(round_.seqs):
            if s.finished:
                continue
            new = s.extend(out_tok[i], out_lp[i], *((top_ids[i], top_lp[i]) if top else ()))
            self.stats["decode_tokens"] += new
            reason = s.stop_reason()
            if s.request.outputs.rounds and (new or reason):
                s.request.outputs.put(s.output(new, reason))
            if reason and self._finish(s, reason):  # its pages, those the round did not fill included, are freed now
                finished.append(s.request)
        return finished

    def _finish(self, seq: Sequence, reason: str) -> bool:
        """Record a sample's completion and free its slot and pages; True when that finished its request."""
        self.scheduler.drop(seq)
        seq.finished = True
        req = seq.request
        req.results[seq.index] = seq.completion(reason, self.policy_version)
        if all(r is not None for r in req.results) and not req.pending_forks:
            return self._end(req, "cancelled" if req.cancelled else "finished")
        return False

    def _end(self, req: EngineRequest, outcome: str) -> bool:
        """The one place a request ends: samples that never started get an empty "cancelled"
        completion, the outcome is counted, the waiters are told. False if it had ended already."""
        if req.done.is_set():
            return False
        for j, r in enumerate(req.results):
            if r is None:
                req.results[j] = Sequence(req, j, 0, list(req.prompt)).completion("cancelled", self.policy_version)
        self.requests.pop(req.id, None)
        self.stats[outcome] += 1
        req.finish()
        return True

    def _apply_cancels(self) -> list[EngineRequest]:
        """The cancels and stops asked for since the last step; returns the requests a stop ended."""
        finished = []
        while self._cancels:
            req, index = self._cancels.popleft()
            if req.done.is_set():  # it ended first: its record is final
                continue
            if index is None:
                req.cancelled = True  # _reap_cancelled ends it
                continue
            scheduled = self.scheduler.running + list(self.scheduler.waiting)
            seq = next((s for s in scheduled if s.request is req and s.index == index), None)
            if seq is not None and self._finish(seq, "stop"):
                finished.append(req)
        return finished

    def _reap_cancelled(self) -> list[EngineRequest]:
        finished = []
        scheduled = self.scheduler.running + list(self.scheduler.waiting)
        for seq in [s for s in scheduled if s.request.cancelled]:
            seq.request.pending_forks = 0
            if self._finish(seq, "cancelled"):
                finished.append(seq.request)
        # A request whose forks never started ends here (its leader's _finish could not end it).
        for req in [r for r in self.requests.values() if r.cancelled]:
            if self._end(req, "cancelled"):
                finished.append(req)
        return finished

    def abort(self, error: str) -> list[EngineRequest]:
        """After a step raised: end every admitted request as failed (`error` is what its waiters
        are told), free every page and forget the round in flight, so the engine serves the next
        request from a clean state. Requests queued since that step stay queued. Returns the failed."""
        with self.lock:
            failed = []
            for req in list(self.requests.values()):
                req.error, req.pending_forks = error, 0
                if self._end(req, "failed"):
                    failed.append(req)
            self.scheduler.clear()
            self._in_flight, self._round_read_at = None, None
            if self.cache is not None and any(x.is_deleted() for x in self.cache):  # donated to the failed call
                self._released = [(x.shape, x.dtype, x.sharding) for x in self.cache]
                self.cache = None
            return failed

    def metrics(self) -> dict:
        """Counters, read without the step lock (a scrape never waits for a step; values may be a step old)."""
        return dict(self.stats) | {
            "queue_depth": len(self._inbox) + len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "preemptions": self.scheduler.preemptions,
            "preempted_tokens": self.scheduler.preempted_tokens,
            "pages_used": self.pages.used,
            "pages_total": self.config.num_pages - 1,
            "compiled_shapes": len(self.shapes_seen),
            "policy_version": self.policy_version,
            **prefix_cache.metrics(self.pages),
        }
