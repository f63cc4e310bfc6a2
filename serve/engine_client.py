"""The routes' one door to the rollout engine: `EngineClient` runs the engine in its thread (warm-up first),
admits requests, submits them, waits for them, cancels them, streams their tokens, scores prompts, swaps
weights, and keeps the set of requests in flight that a shutdown cancels.

The engine reports back through the `rlkjax.engine.records.Listener` each submission gives it (on the engine
thread): a request's end resolves its future on the event loop, and where a route follows the text as it
grows (streams, stop strings) each round's tokens extend every sample's `SampleText` there, between
rounds, so a stop string ends its sample in the round it appears; what is safe to stream goes onto the
submission's queue, which the route reads on the event loop. No route code runs on the engine thread.
"""

import asyncio
import logging
import math
import threading
import time

import rlkjax
from rlkjax.core.checks import check_int
from rlkjax.core.sampling_params import SamplingParams
from rlkjax.engine import compilation_cache
from rlkjax.engine.engine import Engine
from rlkjax.engine.records import EngineRequest, Listener
from serve.http import BadRequest, EngineFailed, RequestTimeout, ShuttingDown, Starting, check_context
from serve.protocol import Limits
from serve.text import SampleText

log = logging.getLogger("serve.rollout")


class Submission:
    """One HTTP request's engine requests, one per prompt with n samples each (choice i*n + j is sample j of
    prompt i): their ends, and where a route follows them, each sample's text as it grows and the events
    of a stream: ("tokens", choice, tokens, logprobs, pieces, tops, finish reason or None), ("done", i)."""

    def __init__(self, prompts: int, n: int, texts: list[SampleText] | None, stream: bool):
        self.loop = asyncio.get_running_loop()
        self.n, self.texts = n, texts
        self.requests: list[EngineRequest] = []
        self.ended = [self.loop.create_future() for _ in range(prompts)]  # prompt i's request ended
        self.queue: asyncio.Queue | None = asyncio.Queue() if stream else None
        choices = len(texts) if texts else 0
        self.tops = [[] for _ in range(choices)]  # per choice and kept token: (top ids, top logprobs) or None
        self.sent = [0] * choices  # tokens streamed per choice
        self.closed = [False] * choices  # its last chunk (with finish_reason) is queued

    def listener(self, i: int) -> Listener:
        return _PromptListener(self, i)

    def on_tokens(self, choice: int, tokens, logprobs, top, reason) -> int | None:
        """Engine thread, after each round: grow the sample's text; queue what is safe to stream (all of it
        once the engine's `reason` or a stop string ends the sample). Returns the tokens to keep on a stop."""
        text, tops = self.texts[choice], self.tops[choice]
        try:
            keep = text.add(tokens, [float(x) for x in logprobs])
            rows = [None] * len(tokens) if top is None else [(i.tolist(), lp.tolist()) for i, lp in zip(*top)]
            tops += rows[: len(text.tokens) - len(tops)]  # those of the tokens the text kept
        except Exception:  # a bug of ours must not end the engine thread; the response checks its tokens
            log.exception("on_tokens failed for choice %d", choice)
            return None
        if self.queue is not None:
            # The engine's finish reason, so a sample's last chunk goes now, not when the prompt's other
            # samples are done too; a stop string found in the text ends it as well.
            reason = "stop" if keep is not None else reason
            if reason:
                text.finish()
            sent = self.sent[choice]
            safe = len(text.tokens) if reason else text.safe_tokens(sent)
            if safe > sent or reason:
                part = (text.tokens[sent:safe], text.logprobs[sent:safe], text.pieces[sent:safe], tops[sent:safe])
                self.sent[choice], self.closed[choice] = safe, reason is not None
                self._put(self.queue.put_nowait, ("tokens", choice, *part, reason))
        return keep

    def on_end(self, i: int) -> None:
        """Engine thread: prompt i's request ended."""
        self._put(self._ended, i)

    def _ended(self, i: int) -> None:
        if not self.ended[i].done():
            self.ended[i].set_result(None)
            if self.queue is not None:
                self.queue.put_nowait(("done", i))

    def _put(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed (the process is exiting): nobody waits any more
            pass


class _PromptListener(Listener):
    """The engine's listener of prompt i of a submission."""

    def __init__(self, submission: Submission, i: int):
        self.submission, self.i = submission, i
        self.follows_tokens = submission.texts is not None

    def on_tokens(self, index, tokens, logprobs, top, reason):
        return self.submission.on_tokens(self.i * self.submission.n + index, tokens, logprobs, top, reason)

    def on_end(self):
        self.submission.on_end(self.i)


class EngineClient:
    """The engine, its thread, and what is in flight. `start()` on the event loop (the thread warms up,
    then serves), `drain()` once a shutdown begins, `cut()` at its deadline, `stop()` at the end."""

    def __init__(self, engine: Engine, tokenizer, chat_template, *, max_prompts: int, max_sequences: int, warmup=True):
        self.engine, self.tokenizer, self.chat_template = engine, tokenizer, chat_template
        self.limits = Limits(engine.cfg.vocab_size, engine.max_context, engine.config.max_batch, max_prompts)
        self.max_sequences = max_sequences
        # The engine thread compiles these first, while the server already answers (/health: "starting").
        self.warm_up_todo = engine.warm_up_shapes() if warmup else []
        self.warmed_up = 0  # shapes of warm_up_todo compiled so far
        self.warm_up_started = time.monotonic()
        self.ready = threading.Event()  # set once the warm-up is done: requests are admitted from then on
        self.failure: BaseException | None = None  # the warm-up failed: the server exits with it
        self.wake = threading.Condition()
        self.stopping = False  # the engine thread exits once idle
        self.draining = False  # a shutdown began: new requests are refused
        self.deadline_passed = False  # a shutdown cancelled what was in flight
        self.cut_event = asyncio.Event()  # set by cut(): waiting handlers answer at once
        self.in_flight: set[EngineRequest] = set()  # submitted and not ended (pruned as they end)
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # ----- the engine thread -----
    def _warm_up(self) -> bool:
        """Compile the default shapes one at a time, logging each; False if stopped or failed first."""
        start, total = time.monotonic(), len(self.warm_up_todo)
        self.warm_up_started = start
        with compilation_cache.CompileTimes() as times:
            if total:
                try:  # several at once; what is not on disk compiles below, one shape at a time
                    loaded = self.engine.load_warm_up()
                    log.info("warm-up: %d of %d shapes' executables read from the cache", loaded, total)
                except Exception:  # the shape's own warm-up below reports it, or compiles past it
                    log.exception("warm-up: reading stored executables failed")
            for name, rows in self.warm_up_todo:
                if self.stopping:
                    return False
                try:
                    seconds = self.engine.warm_up_shape(name, rows)
                except Exception as e:  # e.g. the KV cache does not fit: nothing will ever be served
                    log.exception("warm-up failed at %s, %d rows", name, rows)
                    self.failure = e
                    return False
                self.warmed_up += 1
                log.info("warm-up %d/%d: %s, %d rows, %.1f s", self.warmed_up, total, name, rows, seconds)
        if total:
            log.info("warm-up: %d shapes compiled in %.1f s (%s)", total, time.monotonic() - start, times)
        log.info("ready")
        self.ready.set()
        return True

    def _loop(self):
        if not self._warm_up():
            return
        while True:
            with self.wake:
                while not (self.engine.busy or self.engine.weights_pending or self.stopping):
                    self.wake.wait()
                if self.stopping and not (self.engine.busy or self.engine.weights_pending):
                    return
            try:
                self.engine.step()
            except Exception as e:  # a bug or a device error: fail what it held, keep serving the next requests
                log.exception("engine step failed; failing the requests it held")
                self.engine.abort(f"the engine failed while serving this request: {type(e).__name__}: {e}")

    def kick(self):
        with self.wake:
            self.wake.notify()

    def start(self) -> None:
        self.thread.start()

    async def stop(self, grace: float) -> None:
        """Let the thread finish what it holds and exit; bounded: a step stuck on the device must not keep
        the process alive (the thread is a daemon)."""
        with self.wake:
            self.stopping = True
            self.wake.notify()
        await asyncio.to_thread(self.thread.join, grace)

    def stopped(self) -> bool:
        """The engine thread has exited (or never started)."""
        return not self.thread.is_alive()

    # ----- the model served -----
    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def model_config(self):
        """The served model's rlkjax.ModelConfig."""
        return self.engine.cfg

    @property
    def params(self):
        """The served weights, for a route that swaps a part of them (serve/adapters.py keeps the base)."""
        return self.engine.params

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def metrics(self) -> dict:
        return self.engine.metrics()

    def progress(self) -> str:
        return f"{self.warmed_up}/{len(self.warm_up_todo)} shapes compiled"

    def retry_after(self) -> int:
        """Seconds until the warm-up is likely done, from its pace so far (at least 1)."""
        done, total = self.warmed_up, len(self.warm_up_todo)
        if not done:
            return 5
        return max(1, math.ceil((time.monotonic() - self.warm_up_started) / done * (total - done)))

    # ----- requests -----
    def submit(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        seeds: list[int],
        *,
        texts: list[SampleText] | None = None,
        stream: bool = False,
        max_tokens_name: str = "max_tokens",
    ) -> Submission:
        """Submit every prompt, prompt i with seed seeds[i] (checked first, so a bad one submits nothing).
        texts: one SampleText per choice, grown on the engine thread as tokens come (None: not followed);
        stream: queue the submission's events. max_tokens_name: the route's name for max_tokens."""
        if self.draining:
            raise ShuttingDown("the server is shutting down; retry on another replica")
        if not self.ready.is_set():
            raise Starting(f"the server is starting ({self.progress()}); retry shortly", self.retry_after())
        try:
            check_int("n", sampling.n, 1, self.limits.max_batch)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        sequences = len(prompts) * sampling.n
        if sequences > self.max_sequences:
            raise BadRequest(
                f"{len(prompts)} prompts x n={sampling.n} = {sequences} sequences, over the limit of "
                f"{self.max_sequences} per request (--max-sequences)"
            )
        for p in prompts:  # vLLM's wording for an over-long request, on every route
            check_context(self.engine.max_context, len(p), sampling.max_tokens, max_tokens_name)
        submission, group = Submission(len(prompts), sampling.n, texts, stream), object()
        try:  # this HTTP request's prompts take one turn together in admission
            for i, (p, s) in enumerate(zip(prompts, seeds)):
                self.engine.check_pages(len(p), sampling.max_tokens, max_tokens_name)
                listener = submission.listener(i)
                submission.requests.append(self.engine.submit(p, sampling, seed=s, group=group, listener=listener))
        except ValueError as e:
            self.cancel(submission.requests)
            raise BadRequest(str(e)) from None
        self.in_flight.update(submission.requests)
        self.kick()
        return submission

    def cancel(self, requests) -> None:
        """Cancel requests (a client gone, a timeout): their pages are freed at the next engine step."""
        self.in_flight.difference_update(requests)
        for r in requests:
            self.engine.cancel(r)
        self.kick()

    def release(self, submission: Submission) -> None:
        """The route is done with `submission`: what has not ended is cancelled, nothing stays in flight."""
        if any(not r.done.is_set() for r in submission.requests):
            self.cancel(submission.requests)
        self.in_flight.difference_update(submission.requests)

    async def wait(self, submission: Submission, timeout: float | None = None) -> list[EngineRequest]:
        """Await the submission's requests; a cancelled handler (client gone) or a timeout cancels them and
        frees their pages; a failure or a shutdown's cut raises the error its client gets."""
        try:
            await asyncio.wait_for(self._unless_cut(asyncio.gather(*submission.ended)), timeout)
        except TimeoutError:
            self.cancel(submission.requests)
            raise RequestTimeout(f"the request did not finish within its timeout of {timeout:g} s") from None
        except asyncio.CancelledError:  # client went away: free its pages
            self.cancel(submission.requests)
            raise
        self.in_flight.difference_update(submission.requests)
        self.check_ended(submission.requests)
        return submission.requests

    async def events(self, submission: Submission, timeout: float | None = None):
        """A streamed submission's events, until every prompt's request ended ("done" once each, after
        check_ended); RequestTimeout once `timeout` seconds passed. Call `release` when done with it."""
        done, deadline = set(), None if timeout is None else time.monotonic() + timeout
        while len(done) < len(submission.requests):
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            try:
                event = await asyncio.wait_for(submission.queue.get(), left)
            except TimeoutError:
                raise RequestTimeout(f"the request did not finish within its timeout of {timeout:g} s") from None
            if event[0] == "done":
                done.add(event[1])
                self.check_ended([submission.requests[event[1]]])
            yield event

    async def _unless_cut(self, ended):
        """Await `ended`, or stop waiting once a shutdown cut what was in flight: the engine ends the
        cancelled requests at its next step, which on a busy machine can come after the process has
        exited, so the handler answers 503 now rather than leave its client a dropped connection."""
        cut = asyncio.ensure_future(self.cut_event.wait())
        try:
            await asyncio.wait({ended, cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut.cancel()
        if not ended.done():
            ended.cancel()
            raise ShuttingDown("the server shut down before this request finished (--shutdown-timeout)")
        await ended

    def check_ended(self, requests) -> None:
        """After the engine ended `requests`: raise the error their client gets, if it failed them or a
        shutdown cancelled them."""
        for r in requests:
            if r.error is not None:
                raise EngineFailed(r.error)
        if self.deadline_passed and any(r.cancelled for r in requests):
            raise ShuttingDown("the server shut down before this request finished (--shutdown-timeout)")

    # ----- shutdown -----
    def drain(self) -> None:
        """A shutdown began: refuse new requests, let those in flight finish."""
        self.draining = True

    def pending(self) -> set[EngineRequest]:
        """Submitted requests that have not ended (whatever ended them; their handlers may be gone)."""
        self.in_flight = {r for r in self.in_flight if not r.done.is_set()}
        return self.in_flight

    def cut(self) -> None:
        """The shutdown's deadline: cancel everything in flight; waiting handlers answer 503 at once."""
        self.deadline_passed = True
        for r in list(self.pending()):
            self.engine.cancel(r)
        self.cut_event.set()
        self.kick()

    # ----- weights and scoring -----
    async def update_weights(self, params) -> int:
        """Swap `params` in between engine steps (once in-flight sequences finish); the new policy_version."""
        swapped = self.engine.update_weights(params)
        self.kick()
        while not swapped.is_set():  # polled, not a blocked thread: a shutdown must not wait on it
            if self.deadline_passed:
                raise ShuttingDown("the server shut down before the new weights went live")
            await asyncio.sleep(0.02)
        return self.engine.policy_version

    async def score(self, prompts, temperature: float, top_logprobs: int, version: int | None):
        """The learner's logprobs of each prompt (rlkjax.score from its second token, with `top_logprobs`
        top logprobs), by the weights of policy `version` (None: the current ones): (version, rows)."""
        engine = self.engine
        served, params = engine.policy_version, engine.params
        if version is not None and version != served:
            raise ShuttingDown("the weights changed before the prompt could be scored; retry")
        starts = [1] * len(prompts)  # every prompt token but the first has a logprob
        # One call for all the prompts: the learner's pass gives a row the same bits alone or batched.
        args = (params, engine.cfg, list(prompts), starts, temperature, engine.numerics, top_logprobs)
        return served, await asyncio.to_thread(rlkjax.score, *args)
