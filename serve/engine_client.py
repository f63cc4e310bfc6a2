"""The routes' one door to the rollout engine: `EngineClient` starts the engine's thread
(rlkjax.engine.runner: warm-up first), admits requests, submits them, follows their outputs, cancels them,
scores prompts, swaps weights, and keeps the set of requests in flight that a shutdown cancels.

The engine's one way out is each request's output queue (rlkjax.engine.outputs); an HTTP request's prompts
share one, made for the event loop. `outputs` is one async generator per HTTP request, on the event loop:
each round's tokens grow every sample's `SampleText` there (detokenising, stop strings); a stop string ends
its sample's text at once and asks the engine to stop the sample (`Engine.stop`), as vLLM's output processor
aborts a request whose stop string matched; what is safe to stream is yielded. A non-streamed response is that
stream collected (`wait`). Nothing of serve/ runs on the engine thread.
"""

import asyncio
import logging
import math
import queue
import time

import rlkjax
from rlkjax.core.checks import check_int
from rlkjax.core.sampling_params import SamplingParams
from rlkjax.engine.engine import Engine
from rlkjax.engine.outputs import OutputQueue, SampleOutput
from rlkjax.engine.records import EngineRequest
from rlkjax.engine.runner import EngineThread
from serve.http import BadRequest, EngineFailed, RequestTimeout, ShuttingDown, Starting, check_context
from serve.protocol import Limits
from serve.text import SampleText

log = logging.getLogger("serve.rollout")


class Submission:
    """One HTTP request's engine requests, one per prompt with n samples each (choice i*n + j is sample j of
    prompt i), and the one output queue they share."""

    def __init__(self, n: int, outputs: OutputQueue):
        self.n, self.queue = n, outputs
        self.requests: list[EngineRequest] = []
        self.prompt_of: dict[int, int] = {}  # engine request id -> prompt index


class EngineClient:
    """The engine, its thread, and what is in flight. `start()` on the event loop (the thread warms up,
    then serves), `drain()` once a shutdown begins, `cut()` at its deadline, `stop()` at the end."""

    def __init__(self, engine: Engine, tokenizer, chat_template, *, max_prompts: int, max_sequences: int, warmup=True):
        self.engine, self.tokenizer, self.chat_template = engine, tokenizer, chat_template
        self.limits = Limits(engine.cfg.vocab_size, engine.max_context, engine.config.max_batch, max_prompts)
        self.max_sequences = max_sequences
        # The engine thread compiles these first, while the server already answers (/health: "starting").
        self.runner = EngineThread(engine, engine.warm_up_shapes() if warmup else [])
        self.draining = False  # a shutdown began: new requests are refused
        self.deadline_passed = False  # a shutdown cancelled what was in flight
        self.cut_event = asyncio.Event()  # set by cut(): waiting handlers answer at once
        self.in_flight: set[EngineRequest] = set()  # submitted and not ended (pruned as they end)

    # ----- the engine thread -----
    @property
    def ready(self):
        """Set once the warm-up is done: requests are admitted from then on."""
        return self.runner.ready

    @property
    def failure(self) -> BaseException | None:
        """The warm-up failed: the server exits with it."""
        return self.runner.failure

    @property
    def warm_up_todo(self) -> list:
        return self.runner.warm_up_todo

    def kick(self):
        self.runner.kick()

    def start(self) -> None:
        self.runner.start()

    async def stop(self, grace: float) -> None:
        """Let the thread finish what it holds and exit; bounded (rlkjax.engine.runner)."""
        await asyncio.to_thread(self.runner.stop, grace)

    def stopped(self) -> bool:
        """The engine thread has exited (or never started)."""
        return self.runner.stopped()

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
        return f"{self.runner.warmed_up}/{len(self.warm_up_todo)} shapes compiled"

    def retry_after(self) -> int:
        """Seconds until the warm-up is likely done, from its pace so far (at least 1)."""
        done, total = self.runner.warmed_up, len(self.warm_up_todo)
        if not done:
            return 5
        return max(1, math.ceil((time.monotonic() - self.runner.warm_up_started) / done * (total - done)))

    # ----- requests -----
    def submit(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        seeds: list[int],
        *,
        rounds: bool = False,
        max_tokens_name: str = "max_tokens",
    ) -> Submission:
        """Submit every prompt, prompt i with seed seeds[i] (checked first, so a bad one submits nothing).
        rounds: follow each round's tokens (`outputs` with texts), else only each request's end.
        max_tokens_name: the route's name for max_tokens."""
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
        submission = Submission(sampling.n, OutputQueue(rounds, asyncio.get_running_loop()))
        group = object()  # this HTTP request's prompts take one turn together in admission
        try:
            for i, (p, s) in enumerate(zip(prompts, seeds)):
                self.engine.check_pages(len(p), sampling.max_tokens, max_tokens_name)
                request = self.engine.submit(p, sampling, seed=s, group=group, outputs=submission.queue)
                submission.requests.append(request)
                submission.prompt_of[request.id] = i
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

    async def wait(
        self, submission: Submission, timeout: float | None = None, texts: list[SampleText] | None = None
    ) -> list[EngineRequest]:
        """The submission's outputs collected (`outputs`): its requests once they ended; a cancelled handler (the
        client gone) cancels them and frees their pages."""
        try:
            async for _ in self.outputs(submission, texts, timeout):
                pass
        except asyncio.CancelledError:  # client went away: free its pages
            self.cancel(submission.requests)
            raise
        self.in_flight.difference_update(submission.requests)
        return submission.requests

    async def outputs(self, submission: Submission, texts: list[SampleText] | None = None, timeout=None):
        """The submission's events, on the event loop, until every prompt's request ended. With `texts` (one
        SampleText per choice; submitted with rounds) each round's tokens grow their sample's text here: a stop
        string ends the text and stops the sample in the engine (tokens it sampled after are dropped), the
        engine's finish reason ends it too, and what is safe to stream is yielded as ("tokens", choice, tokens,
        logprobs, pieces, tops, finish reason or None); a sample's last event has its finish reason. ("done", i)
        once prompt i's request ended (after check_ended). RequestTimeout once `timeout` seconds passed (the
        requests cancelled), ShuttingDown once a shutdown cut them. Call `release` when done with it."""
        n, requests = submission.n, submission.requests
        choices = len(texts) if texts else 0
        tops = [[] for _ in range(choices)]  # per choice and kept token: (top ids, top logprobs) or None
        sent = [0] * choices  # tokens yielded per choice
        closed = [False] * choices  # its last event (with a finish reason) is out
        deadline = None if timeout is None else time.monotonic() + timeout
        ended = 0
        while ended < len(requests):
            item = await self._next(submission, deadline, timeout)
            i = submission.prompt_of[item.request]
            if isinstance(item, SampleOutput):
                k = i * n + item.index
                if texts is None or closed[k]:  # a stop string ended it: what the engine sampled after is dropped
                    continue
                text = texts[k]
                keep = text.add(item.tokens, item.logprobs.tolist())
                rows = [None] * len(item.tokens) if item.top is None else list(zip(*(a.tolist() for a in item.top)))
                tops[k] += rows[: len(text.tokens) - len(tops[k])]  # those of the tokens the text kept
                reason = item.finish_reason
                if keep is not None:
                    reason = "stop"
                    self.engine.stop(requests[i], item.index)
                    self.kick()
            else:
                ended += 1
                self.check_ended([requests[i]])
                # Samples whose last event is not out (cancelled ones) end here, with the engine's reason.
                for j in range(n if texts else 0):
                    k, text = i * n + j, texts[i * n + j]
                    if not closed[k]:
                        text.finish()
                        reason = "stop" if text.stopped else item.results[j].finish_reason
                        rest = slice(sent[k], None)
                        part = (text.tokens[rest], text.logprobs[rest], text.pieces[rest], tops[k][rest])
                        sent[k], closed[k] = len(text.tokens), True
                        yield ("tokens", k, *part, reason)
                yield ("done", i)
                continue
            if reason:
                text.finish()
            safe = len(text.tokens) if reason else text.safe_tokens(sent[k])
            if safe > sent[k] or reason:
                done = slice(sent[k], safe)
                part = (text.tokens[done], text.logprobs[done], text.pieces[done], tops[k][done])
                sent[k], closed[k] = safe, reason is not None
                yield ("tokens", k, *part, reason)

    async def _next(self, submission: Submission, deadline: float | None, timeout: float | None):
        """The submission's next output; RequestTimeout at the deadline (its requests cancelled), ShuttingDown once
        a shutdown's cut cancelled what was in flight: the engine ends those requests at its next step, which on a
        busy machine can come after the process has exited, so the handler answers now."""
        try:
            return submission.queue.get_nowait()
        except queue.Empty:  # wait for the engine
            pass
        left = None if deadline is None else max(deadline - time.monotonic(), 0)
        got = asyncio.ensure_future(submission.queue.get())
        cut = asyncio.ensure_future(self.cut_event.wait())
        try:
            await asyncio.wait({got, cut}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            got.cancel()
            cut.cancel()
        if got.done() and not got.cancelled():
            return got.result()
        if cut.done() and not cut.cancelled():
            raise ShuttingDown("the server shut down before this request finished (--shutdown-timeout)")
        self.cancel(submission.requests)
        raise RequestTimeout(f"the request did not finish within its timeout of {timeout:g} s")

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
