"""The engine's host-side records: an EngineRequest (its SamplingParams, its samples' results, the output queue
its caller follows it by), each sample's sequence (tokens, logprobs, KV pages), the page allocator they share,
a decode round in flight, and the finished Completion."""

import dataclasses
import threading
from collections import deque

import numpy as np

from rlkjax.core.sampling_params import SamplingParams, at_stop
from rlkjax.core.shapes import bucket
from rlkjax.engine.outputs import OutputQueue, RequestEnd, SampleOutput, frozen_array
from rlkjax.engine.programs import RowSampling


@dataclasses.dataclass
class Completion:
    tokens: list[int]
    # float32, one per token: log p(token | prefix) at the sampling temperature (greedy: T = 1), over the
    # full vocabulary even when top_k/top_p/min_p truncated the draw (the learner's value), or over the
    # renormalised kept set when the request asked for truncated_logprobs
    logprobs: np.ndarray
    finish_reason: str = "length"  # "length" | "stop" | "cancelled"
    policy_version: int = 0
    # Asked for with top_logprobs=k: per token, the k most likely ids of the same distribution
    # (descending; equal values: lowest id first) [T, k] int32, and their logprobs [T, k] float32.
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    # Asked for with prompt_logprobs (rlkjax.generate): the learner's logprobs of prompt[1:] [P - 1],
    # and, with prompt_logprobs=k > 0, the k most likely ids at each position and their logprobs [P - 1, k].
    prompt_logprobs: np.ndarray | None = None
    prompt_top_ids: np.ndarray | None = None
    prompt_top_logprobs: np.ndarray | None = None


class PageAllocator:
    """Free list with reference counts; page 0 is the trash page and never handed out. Without the
    prefix cache (rlkjax.engine.prefix_cache.PrefixCache keeps pages by their tokens) a released page is free."""

    def __init__(self, num_pages: int):
        self.free = deque(range(1, num_pages))
        self.refs = np.zeros(num_pages, np.int32)

    @property
    def available(self) -> int:
        """Pages `alloc` can hand out."""
        return len(self.free)

    def take(self, tokens, n: int) -> tuple[list[int], int] | None:
        """n pages for a sequence of `tokens` that holds none, and how many positions they hold already
        (0: no prefix cache); None if too few are free."""
        pages = self.alloc(n)
        return None if pages is None else (pages, 0)

    def keep(self, tokens, pages: list[int], written: int):
        """Where a prefix cache is on, index a leaving sequence's written full pages; here nothing."""

    def forget(self):
        """Where a prefix cache is on, empty its index; here nothing."""

    def reset(self):
        """Every page free (after a failed step)."""
        self.free = deque(range(1, len(self.refs)))
        self.refs[:] = 0

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        pages = [self.free.popleft() for _ in range(n)]
        self.refs[pages] = 1
        return pages

    def share(self, pages):
        for p in pages:
            self.refs[p] += 1

    def release(self, pages):
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)

    @property
    def used(self) -> int:
        return int((self.refs > 0).sum())


@dataclasses.dataclass(eq=False)
class Sequence:
    request: "EngineRequest"
    index: int  # sample index within the request
    seed: int
    tokens: list[int]  # prompt + generated
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_ids: list = dataclasses.field(default_factory=list)  # [k] arrays, one per token (top_logprobs=k)
    top_logprobs: list = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    cached: int = 0  # positions whose K/V are in the cache
    admitted: int = -1  # admission order, for preemption
    finished: bool = False  # its completion is recorded; a round still in flight skips it

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    @property
    def decoding(self) -> bool:
        return self.cached == len(self.tokens) - 1

    @property
    def started(self) -> bool:
        """Its pages or tokens came from the current weights: it must finish before a swap."""
        return bool(self.pages) or self.generated > 0

    def extend(self, tokens, logprobs, top_ids=None, top_logprobs=None) -> int:
        """Append a decode round's row (tokens [S], -1 after the row stopped; logprobs [S]; with
        top_logprobs=k the top logprobs [S, K]); returns how many tokens it added."""
        k = self.request.sampling.top_logprobs
        new = int((tokens >= 0).sum())
        self.tokens += [int(t) for t in tokens[:new]]
        self.logprobs += list(logprobs[:new])
        if k:
            self.top_ids += [top_ids[j, :k] for j in range(new)]
            self.top_logprobs += [top_logprobs[j, :k] for j in range(new)]
        self.cached += new
        return new

    def stop_reason(self) -> str | None:
        """Why it ends now: "stop" (a stop id, once min_tokens are in), "length" (max_tokens), or None."""
        sampling = self.request.sampling
        stop_ids = np.asarray(self.request.stop_ids, np.int64)
        if at_stop(np.int64(self.tokens[-1]), self.generated, stop_ids, sampling.min_tokens):
            return "stop"
        return "length" if self.generated >= sampling.max_tokens else None

    def output(self, new: int, reason: str | None) -> SampleOutput:
        """The round's `new` tokens (their logprobs, their top logprobs if asked) and the engine's finish reason
        (None: the sample goes on), as its request's queue hands them out."""
        k = self.request.sampling.top_logprobs
        top = None
        if k:
            top = (
                frozen_array(self.top_ids[len(self.top_ids) - new :], np.int32).reshape(-1, k),
                frozen_array(self.top_logprobs[len(self.top_logprobs) - new :], np.float32).reshape(-1, k),
            )
        tokens = tuple(self.tokens[len(self.tokens) - new :])
        logprobs = frozen_array(self.logprobs[len(self.logprobs) - new :], np.float32)
        return SampleOutput(self.request.id, self.index, tokens, logprobs, top, reason)

    def completion(self, reason: str, policy_version: int) -> "Completion":
        comp = Completion(
            self.tokens[len(self.request.prompt) :], np.asarray(self.logprobs, np.float32), reason, policy_version
        )
        k = self.request.sampling.top_logprobs
        if k:  # [T, k]; T = 0 for a sample cancelled before it started
            comp.top_ids = np.asarray(self.top_ids, np.int32).reshape(-1, k)
            comp.top_logprobs = np.asarray(self.top_logprobs, np.float32).reshape(-1, k)
        return comp


@dataclasses.dataclass(eq=False)
class EngineRequest:
    """The engine's record of one submitted prompt and its n samples (`Engine.submit`); an HTTP request
    (serve's `request`, aiohttp's) becomes one per prompt. Once a step took it in, only the engine's thread
    writes it (checked where Python runs its asserts); its caller reads it after `done`, asks for a cancel or
    a stop through the engine, and follows it through its `outputs` queue."""

    id: int
    prompt: list[int]
    sampling: SamplingParams
    stop_ids: tuple[int, ...]  # the ids that end a sample: sampling.stop_ids(the engine's eos)
    group: object = None  # admission shares slots fairly between groups (the server: one per HTTP request)
    results: list = dataclasses.field(default_factory=list)  # Completion per sample index, None until done
    pending_forks: int = 0  # samples waiting for the leader's prompt pages
    cancelled: bool = False
    error: str | None = None  # why the engine failed it (Engine.abort); None otherwise
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    outputs: OutputQueue = dataclasses.field(default_factory=OutputQueue)  # the engine's one way out to its caller

    def __setattr__(self, name, value):
        writer = self.__dict__.get("_writer")
        assert writer in (None, threading.get_ident()), f"EngineRequest.{name} written off the engine's thread"
        super().__setattr__(name, value)

    def take(self):
        """A step takes the request in: from now on only this thread writes it."""
        self.__dict__["_writer"] = threading.get_ident()

    def finish(self):
        """It ended: `done` is set, then its end goes onto its queue (after every output of its rounds)."""
        self.done.set()
        self.outputs.put(RequestEnd(self.id, tuple(self.results), self.error))


@dataclasses.dataclass
class Round:
    """A decode round dispatched to the device and not read yet."""

    seqs: list[Sequence]  # row i's sequence
    budget: list[int]  # tokens row i may sample (it samples all of them unless it stops)
    out: tuple  # device arrays: tokens, logprobs (and top logprobs)
    carry: tuple  # device arrays: next_round's carry


def round_rows(seqs: list[Sequence], ahead: dict, budget: dict, rows: int, vocab_size: int):
    """A decode round's inputs for `seqs`, padded to `rows`: each row's last token and its position
    [rows] and its sampling options (RowSampling). ahead[s]: tokens the round in flight may still add
    to s; budget[s]: tokens this round may sample."""
    stops = bucket(max(len(s.request.stop_ids) for s in seqs))
    tokens, positions, remaining = np.zeros(rows, np.int32), np.full(rows, -1, np.int32), np.zeros(rows, np.int32)
    seeds, steps, temps = np.zeros(rows, np.uint32), np.zeros(rows, np.int32), np.ones(rows, np.float32)
    stop_ids, min_tokens = np.full((rows, stops), -1, np.int32), np.zeros(rows, np.int32)
    for i, s in enumerate(seqs):
        tokens[i], positions[i], remaining[i] = s.tokens[-1], len(s.tokens) - 1 + ahead[s], budget[s]
        seeds[i], steps[i], temps[i] = s.seed, s.generated + ahead[s], s.request.sampling.temperature
        stop_ids[i, : len(s.request.stop_ids)] = s.request.stop_ids
        min_tokens[i] = s.request.sampling.min_tokens
    # One variant for rounds with a truncating row; the other rows run it untruncated (top_k = vocab,
    # top_p = 1, min_p = 0), which draws their default tokens and bits.
    truncation = _truncation(seqs, rows, vocab_size) if any(s.request.sampling.truncates for s in seqs) else None
    return tokens, positions, RowSampling(seeds, steps, temps, remaining, stop_ids, min_tokens, truncation)


def _truncation(seqs: list[Sequence], rows: int, vocab_size: int) -> tuple:
    """(top_k, top_p, min_p, renormalised) [rows] as the kernels take them (top_k 0 -> the vocabulary: off)."""
    top_k = np.full(rows, vocab_size, np.int32)
    top_p, min_p = np.ones(rows, np.float32), np.zeros(rows, np.float32)
    renormalised = np.zeros(rows, bool)
    for i, s in enumerate(seqs):
        r = s.request.sampling
        top_k[i] = min(r.top_k, vocab_size) or vocab_size
        top_p[i], min_p[i], renormalised[i] = r.top_p, r.min_p, r.truncated_logprobs
    return top_k, top_p, min_p, renormalised
