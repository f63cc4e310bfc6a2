"""`python -m serve.rollout`: the rollout engine behind an HTTP server.

Endpoints (JSON in and out; errors are 4xx with OpenAI's {"error": {"message", "type", "param", "code"}}
and the server keeps serving; a request without a seed gets a fresh one, reported as "seed"):
  POST /generate         token ids in; per sample: tokens, logprobs, finish_reason, policy_version (a sampled
                         eos of the tokenizer ends a sample and is its last token, unless ignore_eos)
  POST /v1/completions, POST /v1/chat/completions
                         OpenAI-compatible (serve/openai_api.py; the README's API section lists the fields),
                         streaming or not, using the model's tokenizer and chat template
  POST /inference/v1/generate
                         vLLM's token route (serve/token_route.py): token ids and sampling_params in; per
                         sample token ids, logprobs as {"token": "token_id:<id>", "logprob"}, finish_reason
  POST /update_weights   {"path": checkpoint dir}; needs `Authorization: Bearer <admin key>`;
                         swapped between engine steps once in-flight sequences finish
  GET  /v1/models       the served model (OpenAI list shape, with vLLM's max_model_len)
  GET  /health           200 {"status": "ok"} once ready; while the warm-up compiles, 503 {"status": "starting",
                         "progress": "k/N shapes compiled"} (generation routes: 503 with Retry-After); once a
                         shutdown began, 503 {"status": "draining"}
  GET  /metrics          Prometheus text format
Optional fields may be absent or null (= the default).

HTTP stack: aiohttp. One mature, asyncio-native package gives the server with request-size limits; the
engine runs in one background thread and resolves each request's future through the event loop. Every
request ends once (finished, cancelled or failed: /metrics counts each), and a shutdown drains for at
most --shutdown-timeout plus a short grace, whatever the clients or the engine do (Server.on_signal). Logprobs are JSON
doubles written by Python's shortest round-trip repr, so float32(json value) has the sampler's bits.
"""

# This file is the Server: request bookkeeping, the engine thread, the drain and the routes. Its flags live in
# serve/config.py, listening and signals in serve/lifecycle.py, /update_weights in serve/weights.py, /metrics in
# serve/metrics.py, the OpenAI routes in serve/openai_api.py.

import asyncio
import dataclasses
import logging
import math
import os
import secrets
import sys
import threading
import time

import tyro
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from rlkjax import compilation_cache
from rlkjax.chat import load_chat_template
from rlkjax.checkpoint import load_model
from rlkjax.engine import Engine
from rlkjax.requests import check_int, check_seed, sample_seed
from rlkjax.sampling_params import SamplingParams
from rlkjax.sequences import Request
from rlkjax.tokenizer import load_tokenizer
from serve import openai_api, token_route, weights
from serve.auth import AdminAuth
from serve.config import ServerConfig, admin_key
from serve.http import (
    BadRequest,
    EngineFailed,
    RequestTimeout,
    ShuttingDown,
    Starting,
    _errors,
    _fields,
    _json,
    _json_response,
    _opt,
    _prompts,
    check_context,
)
from serve.lifecycle import SECOND_SIGNAL_GRACE_S, SHUTDOWN_GRACE_S, serve
from serve.metrics import EngineMetrics

log = logging.getLogger("serve.rollout")


class Server:
    def __init__(self, config: ServerConfig):
        self.config = config
        key = admin_key(config)
        self.admin = AdminAuth(key) if key else None
        self.cfg, params = load_model(config.model, seed=config.seed)
        bad = weights.non_finite(params)
        if bad:
            raise ValueError(
                f"--model {config.model}: non-finite values in {', '.join(bad[:10])}; refusing to serve them"
            )
        self.tokenizer = load_tokenizer(config.model, config.tokenizer)
        self.chat_template = load_chat_template(self.tokenizer)
        eos = self.tokenizer.eos_token_id  # the one eos policy (SamplingParams.stop_ids) applies on every route
        eos = eos if eos is not None and eos < self.cfg.vocab_size else None
        self.engine = Engine(params, self.cfg, config.numerics, config.engine, eos_token_id=eos)
        # The engine thread compiles these first, while the server already answers (/health: "starting").
        self.warm_up_todo = self.engine.warm_up_shapes() if config.warmup else []
        self.warmed_up = 0  # shapes of warm_up_todo compiled so far
        self.warm_up_started = time.monotonic()
        self.ready = threading.Event()  # set once the warm-up is done: requests are admitted from then on
        self.failure: BaseException | None = None  # the warm-up failed: the server exits with it
        self.wake = threading.Condition()
        self.stopping = False  # the engine thread exits once idle
        self.draining, self.deadline_passed, self.deadline = False, False, math.inf
        self.grace = SHUTDOWN_GRACE_S  # after the deadline's cancellations, for the handlers to answer
        self.cut = asyncio.Event()  # set when a shutdown cancels what is in flight: its handlers answer at once
        self.in_flight: set[Request] = set()  # submitted and not ended (pruned as they end): cancelled at the deadline
        self.handlers = 0  # route handlers running (a stream until its last event): the drain waits for them
        self.started = time.time()
        self.registry = CollectorRegistry()
        self.registry.register(EngineMetrics(self.engine, self.started))
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # ----- engine thread -----
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

    def submit(self, prompts, sampling: SamplingParams, seeds, hooks=None) -> list[Request]:
        """Submit every prompt, prompt i with seed seeds[i] (validated first, so a bad one submits
        nothing). hooks: one engine `on_tokens` hook per prompt, or None."""
        if self.draining:
            raise ShuttingDown("the server is shutting down; retry on another replica")
        if not self.ready.is_set():
            raise Starting(f"the server is starting ({self.progress()}); retry shortly", self.retry_after())
        try:
            check_int("n", sampling.n, 1, self.engine.config.max_batch)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        sequences = len(prompts) * sampling.n
        if sequences > self.config.max_sequences:
            raise BadRequest(
                f"{len(prompts)} prompts x n={sampling.n} = {sequences} sequences, over the limit of "
                f"{self.config.max_sequences} per request (--max-sequences)"
            )
        for p in prompts:  # vLLM's wording for an over-long request, on every route
            check_context(self.engine.max_context, len(p), sampling.max_tokens)
        requests, group = [], object()  # this HTTP request's prompts take one turn together in admission
        try:
            for i, (p, s) in enumerate(zip(prompts, seeds)):
                hook = None if hooks is None else hooks[i]
                requests.append(self.engine.submit(p, sampling, seed=s, group=group, on_tokens=hook))
        except ValueError as e:
            self.cancel(requests)
            raise BadRequest(str(e)) from None
        self.in_flight.update(requests)
        self.kick()
        return requests

    def pending(self) -> set[Request]:
        """Submitted requests that have not ended (whatever ended them; their handlers may be gone)."""
        self.in_flight = {r for r in self.in_flight if not r.done.is_set()}
        return self.in_flight

    def cancel(self, requests):
        """Cancel requests (a client gone, a timeout): their pages are freed at the next engine step."""
        self.in_flight.difference_update(requests)
        for r in requests:
            self.engine.cancel(r)
        self.kick()

    def when_done(self, request: Request, callback) -> None:
        """Call `callback()` on the event loop once the engine finished `request` (at once if it has)."""
        loop = asyncio.get_running_loop()
        request.callbacks.append(lambda: loop.call_soon_threadsafe(callback))
        if request.done.is_set():
            loop.call_soon(callback)  # it may also run from the engine's call: callbacks must be idempotent

    async def wait(self, requests, timeout: float | None = None) -> list[Request]:
        """Await the requests; a cancelled handler (client gone) or a timeout cancels them and frees their pages."""
        loop = asyncio.get_running_loop()
        futures = []
        for r in requests:
            fut = loop.create_future()
            self.when_done(r, lambda fut=fut: fut.done() or fut.set_result(None))
            futures.append(fut)
        try:
            await asyncio.wait_for(self._unless_cut(asyncio.gather(*futures)), timeout)
        except TimeoutError:
            self.cancel(requests)
            raise RequestTimeout(f"the request did not finish within its timeout of {timeout:g} s") from None
        except asyncio.CancelledError:  # client went away: free its pages
            self.cancel(requests)
            raise
        self.in_flight.difference_update(requests)
        self.check_ended(requests)
        return requests

    async def _unless_cut(self, ended):
        """Await `ended`, or stop waiting once a shutdown cut what was in flight: the engine ends the
        cancelled requests at its next step, which on a busy machine can come after the process has
        exited, so the handler answers 503 now rather than leave its client a dropped connection."""
        cut = asyncio.ensure_future(self.cut.wait())
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

    @staticmethod
    def seeds(body, prompts: int, n: int) -> tuple[list, int | list]:
        """(one seed per prompt, the seed to report). A list: one seed per prompt, taken as given. An int
        s: prompt i starts at sample_seed(s, i * n), so every sequence of the batch draws its own noise.
        None or absent: a fresh seed from the OS, reported in the response so the sample can be redone
        (a fixed default would give every unseeded request the same completion)."""
        seed = body.get("seed")
        if seed is None:
            seed = secrets.randbits(32)
        if isinstance(seed, list):
            if len(seed) != prompts:
                raise BadRequest(f"seed must be an integer or a list of {prompts} integers (one per prompt)")
            return seed, seed
        try:
            seed = check_seed("seed", seed)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        return [sample_seed(seed, i * n) for i in range(prompts)], seed

    # ----- handlers -----
    async def generate(self, request: web.Request):
        body = _fields(
            await _json(request, self.config.read_timeout),
            {"prompt", "n", "max_new_tokens", "temperature", "seed", "stop_token_ids", "ignore_eos"},
            {"prompt"},
        )
        prompts = _prompts(body["prompt"])
        if len(prompts) > self.config.max_prompts:
            raise BadRequest(f"at most {self.config.max_prompts} prompts per request, got {len(prompts)}")
        try:
            sampling = SamplingParams(
                n=_opt(body, "n", 1),
                max_tokens=_opt(body, "max_new_tokens", 16),
                temperature=_opt(body, "temperature", 1.0),
                stop_token_ids=_opt(body, "stop_token_ids", []),
                ignore_eos=_opt(body, "ignore_eos", False),
            )
            seeds, seed = self.seeds(body, len(prompts), sampling.n)
            requests = self.submit(prompts, sampling, seeds)
        except ValueError as e:  # this route's name for max_tokens is max_new_tokens
            raise BadRequest(str(e).replace("max_tokens", "max_new_tokens")) from None
        reqs = await self.wait(requests)
        return _json_response(
            {
                "seed": seed,
                "results": [
                    [dataclasses.asdict(c) | {"logprobs": c.logprobs.tolist()} for c in r.results] for r in reqs
                ],
            }
        )

    async def update_weights(self, request: web.Request):
        return await weights.update_weights(self, request)

    async def completions(self, request: web.Request):
        return await openai_api.completions(self, request)

    async def chat_completions(self, request: web.Request):
        return await openai_api.chat_completions(self, request)

    async def generate_tokens(self, request: web.Request):
        return await token_route.generate(self, request)

    def encode(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON can carry lone surrogates ("\ud800"), which are not text
            raise BadRequest(f"prompt is not valid Unicode: {e.reason} at character {e.start}") from None
        return self.tokenizer.encode(text)

    async def models(self, request):
        """GET /v1/models: the one served model, in OpenAI's list shape."""
        return _json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.model,
                        "object": "model",
                        "created": int(self.started),
                        "owned_by": "rlkjax",
                        "policy_version": self.engine.policy_version,
                        "max_model_len": self.engine.max_context,
                    }
                ],
            }
        )

    def progress(self) -> str:
        return f"{self.warmed_up}/{len(self.warm_up_todo)} shapes compiled"

    def retry_after(self) -> int:
        """Seconds until the warm-up is likely done, from its pace so far (at least 1)."""
        done, total = self.warmed_up, len(self.warm_up_todo)
        if not done:
            return 5
        return max(1, math.ceil((time.monotonic() - self.warm_up_started) / done * (total - done)))

    async def health(self, request):
        """ok (200); starting (503, with progress) until warmed up; draining (503) once a shutdown began, so a
        load balancer stops sending."""
        if self.draining:
            return _json_response({"status": "draining", "policy_version": self.engine.policy_version}, status=503)
        if not self.ready.is_set():
            body = {"status": "starting", "progress": self.progress(), "policy_version": self.engine.policy_version}
            return _json_response(body, status=503)
        return _json_response({"status": "ok", "policy_version": self.engine.policy_version})

    async def metrics(self, request):
        return web.Response(body=generate_latest(self.registry), content_type="text/plain", charset="utf-8")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._track, _errors])
        app.add_routes(
            [
                web.post("/generate", self.generate),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.post("/inference/v1/generate", self.generate_tokens),
                web.post("/update_weights", self.update_weights),
                web.get("/health", self.health),
                web.get("/v1/models", self.models),
                web.get("/metrics", self.metrics),
            ]
        )
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._shutdown)
        return app

    @web.middleware
    async def _track(self, request, handler):
        """Count running handlers, so a shutdown waits for their answers (and only for a bounded time)."""
        self.handlers += 1
        try:
            return await handler(request)
        finally:
            self.handlers -= 1

    async def _startup(self, app):
        self.thread.start()

    async def _shutdown(self, app):
        with self.wake:
            self.stopping = True
            self.wake.notify()
        # bounded: a step stuck on the device must not keep the process alive (the thread is a daemon)
        await asyncio.to_thread(self.thread.join, self.grace)

    def on_signal(self):
        """First signal: drain (/health 503, new work 503) until idle or --shutdown-timeout. Another: cancel what
        is left now and give its handlers a moment to answer."""
        if self.draining:
            log.info("second signal: cancelling what is still in flight and exiting")
            self.deadline, self.grace = min(self.deadline, time.monotonic()), SECOND_SIGNAL_GRACE_S
            return
        log.info("signal: draining for up to %.0f s", self.config.shutdown_timeout)
        self.draining, self.deadline = True, time.monotonic() + self.config.shutdown_timeout

    async def wait_until_drained(self):
        """Return once a signal came and every request has ended and been answered; at the deadline, cancel
        what is left (its handlers answer 503) and return once answered, or `grace` seconds later regardless:
        a request whose handler is gone, or a handler that cannot finish, never holds the process."""
        cut_at = None
        while not self.draining or self.pending() or self.handlers:
            if self.failure is not None:
                raise SystemExit(f"warm-up failed: {type(self.failure).__name__}: {self.failure}")
            now = time.monotonic()
            if self.draining and now >= self.deadline:
                if cut_at is None:
                    cut_at, self.deadline_passed = now, True
                    for r in list(self.pending()):
                        self.engine.cancel(r)
                    self.cut.set()
                    self.kick()
                if now >= cut_at + self.grace:
                    log.warning(
                        "exiting with %d requests and %d handlers unfinished", len(self.pending()), self.handlers
                    )
                    return
            await asyncio.sleep(0.05)


def main(config: ServerConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    compilation_cache.enable(config.compilation_cache)  # before the first compilation (loading checks weights)
    server = Server(config)
    asyncio.run(serve(server))
    if server.thread.is_alive():
        # A shutdown cut the engine's step short. Finalising the interpreter while that thread is still
        # inside XLA can abort the process (SIGABRT, seen under load); every answer has been sent, so the
        # process leaves without finalising, with exit status 0.
        log.info("exiting while the engine thread finishes its step")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(tyro.cli(ServerConfig, description=__doc__))
