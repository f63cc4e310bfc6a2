"""`python -m serve.rollout`: the rollout engine behind an HTTP server.

Endpoints (JSON in and out; errors are 4xx with OpenAI's {"error": {"message", "type", "param", "code"}}
and the server keeps serving; a request without a seed gets a fresh one, reported as "seed"):
  POST /generate         token ids in; per sample: tokens, logprobs, finish_reason, policy_version (a sampled
                         eos of the tokenizer ends a sample and is its last token, unless ignore_eos)
  POST /v1/completions, POST /v1/chat/completions
                         OpenAI-compatible (serve/openai_api.py; the README's API section lists the fields),
                         streaming or not, using the model's tokenizer and chat template
  POST /update_weights   {"path": checkpoint dir}; needs `Authorization: Bearer <admin key>`;
                         swapped between engine steps once in-flight sequences finish
  GET  /v1/models       the served model (OpenAI list shape)
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

import asyncio
import dataclasses
import logging
import math
import os
import secrets
import signal
import threading
import time
from pathlib import Path
from typing import Annotated, Literal

import jax
import jax.numpy as jnp
import tyro
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from rlkjax import compilation_cache
from rlkjax.chat import load_chat_template
from rlkjax.checkpoint import load_model
from rlkjax.engine import Engine, EngineConfig
from rlkjax.requests import check_int, check_seed, sample_seed, shown
from rlkjax.sampling_params import SamplingParams
from rlkjax.sequences import Request
from rlkjax.tokenizer import load_tokenizer
from serve import openai_api
from serve.auth import AdminAuth
from serve.connections import LimitedRunner
from serve.http import (
    BadRequest,
    EngineFailed,
    RequestTimeout,
    ShuttingDown,
    Starting,
    _error,
    _errors,
    _fields,
    _json,
    _json_response,
    _opt,
    _prompts,
)

log = logging.getLogger("serve.rollout")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model: str = "qwen3-tiny"
    """A preset (random weights from --seed), an HF checkpoint dir, or an orbax dir (config.json + params/)."""
    tokenizer: str | None = None
    """'bytes' (the tiny model's byte tokenizer) or a directory with tokenizer.json. Default: the byte tokenizer for
    a preset, the checkpoint's own tokenizer.json otherwise (a checkpoint without one is an error)."""
    host: str = "127.0.0.1"
    """Interface to bind. The default serves this machine only; 0.0.0.0 exposes it to the network."""
    port: int = 8000
    """TCP port."""
    admin_key: str | None = None
    """Key for POST /update_weights. Prefer --admin-key-file or RLKJAX_ADMIN_KEY: a flag is visible in `ps`. With
    none of the three, weight updates are refused."""
    admin_key_file: str | None = None
    """File holding the admin key (its first line)."""
    seed: int = 0
    """Seed of the random weights when --model is a preset."""
    numerics: Literal["strict", "fast"] = "strict"
    """strict: our Pallas kernels, logprobs equal the learner's bit for bit. fast: plain XLA."""
    engine: Annotated[EngineConfig, tyro.conf.OmitArgPrefixes] = EngineConfig(max_context=4096)
    """The rollout engine: KV cache, batch and prefill sizes."""
    max_prompts: int = 256
    """Most prompts in one request."""
    max_sequences: int = 256
    """Most sequences (prompts x n) in one request; requests also take turns in admission, so a big one cannot
    hold back a small one that came after it."""
    read_timeout: float = 30.0
    """Seconds a client has to send its whole request body (a slow client gets 408)."""
    max_body_bytes: int = 4 * 2**20
    """Larger request bodies get 413."""
    header_timeout: float = 15.0
    """Seconds a connection has to send a complete request head, from opening or from the end of its previous
    response; then it is closed (a client trickling its headers, an idle keep-alive connection)."""
    max_connections: int = 512
    """Most open connections; past it a new connection gets 503 and is closed. Each open connection needs a file
    descriptor: keep this under the process's limit (`ulimit -n`)."""
    warmup: bool = True
    """Compile every batch shape of default requests before accepting any (prefill and decode rounds of 1, 2, 4,
    ... --max-batch sequences, page copies for n > 1): a few seconds per shape (far less from a warm
    --compilation-cache), so no request waits behind a compilation mid-serving. The server listens meanwhile:
    /health answers 503 "starting" with the progress, generation routes 503 with Retry-After. Options such as
    top_logprobs, top_k/top_p/min_p or several stop ids still compile on first use. --no-warmup is ready at
    once."""
    compilation_cache: str = compilation_cache.default_dir()
    """JAX's persistent compilation cache: a directory (created if missing), or 'off'. A restarted server loads
    the programs an earlier one compiled (the same executables, so the same bits) and warms up in a fraction of
    the time. Delete the directory to reclaim its space."""
    shutdown_timeout: float = 300.0
    """On SIGTERM/SIGINT: /health turns 503 "draining" and new work gets 503; what is in flight finishes for up
    to this many seconds, then the rest is cancelled (its clients get 503, a stream its error event and [DONE])
    and the process exits 0. A second signal cancels at once and exits within a second."""

    def __post_init__(self):
        for name in ("port", "max_prompts", "max_sequences", "max_body_bytes", "max_connections"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be positive")
        if not (math.isfinite(self.shutdown_timeout) and self.shutdown_timeout >= 0):
            raise ValueError(f"--shutdown-timeout={self.shutdown_timeout} must be a finite number >= 0")
        for name in ("read_timeout", "header_timeout"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be a finite number > 0")
        compilation_cache.check(self.compilation_cache)


@jax.jit
def _all_finite(params):
    """One flag per leaf. One program for the whole tree, compiled at start-up (the served weights
    are checked there) and reused by every /update_weights: not an eager reduction per array."""
    return [jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(params)]


def _non_finite(params) -> list[str]:
    """Paths of the parameters holding NaN or Inf."""
    flags = jax.device_get(_all_finite(params))
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)]
    return [path for path, ok in zip(paths, flags, strict=True) if not ok]


# Once a shutdown cancelled what was left (deadline or second signal), how long its handlers get to answer
# before the process exits regardless: cancelled requests end at the engine's next step.
SHUTDOWN_GRACE_S, SECOND_SIGNAL_GRACE_S = 5.0, 0.5


def _admin_key(config: ServerConfig) -> str | None:
    if config.admin_key_file:
        lines = Path(config.admin_key_file).read_text().splitlines()
        if not lines or not lines[0].strip():
            raise ValueError(f"--admin-key-file {config.admin_key_file} is empty")
        return lines[0].strip()
    return config.admin_key or os.environ.get("RLKJAX_ADMIN_KEY") or None


class Server:
    def __init__(self, config: ServerConfig):
        self.config = config
        admin_key = _admin_key(config)
        self.admin = AdminAuth(admin_key) if admin_key else None
        self.cfg, params = load_model(config.model, seed=config.seed)
        bad = _non_finite(params)
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
        self.in_flight: set[Request] = set()  # submitted and not ended (pruned as they end): cancelled at the deadline
        self.handlers = 0  # route handlers running (a stream until its last event): the drain waits for them
        self.started = time.time()
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # ----- engine thread -----
    def _warm_up(self) -> bool:
        """Compile the default shapes one at a time, logging each; False if stopped or failed first."""
        start, total = time.monotonic(), len(self.warm_up_todo)
        self.warm_up_started = start
        with compilation_cache.CompileTimes() as times:
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

    def _kick(self):
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
        requests, group = [], object()  # this HTTP request's prompts take one turn together in admission
        try:
            for i, (p, s) in enumerate(zip(prompts, seeds)):
                hook = None if hooks is None else hooks[i]
                requests.append(self.engine.submit(p, sampling, seed=s, group=group, on_tokens=hook))
        except ValueError as e:
            self.cancel(requests)
            raise BadRequest(str(e)) from None
        self.in_flight.update(requests)
        self._kick()
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
        self._kick()

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
            await asyncio.wait_for(asyncio.gather(*futures), timeout)
        except TimeoutError:
            self.cancel(requests)
            raise RequestTimeout(f"the request did not finish within its timeout of {timeout:g} s") from None
        except asyncio.CancelledError:  # client went away: free its pages
            self.cancel(requests)
            raise
        self.in_flight.difference_update(requests)
        self.check_ended(requests)
        return requests

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

    async def completions(self, request: web.Request):
        return await openai_api.completions(self, request)

    async def chat_completions(self, request: web.Request):
        return await openai_api.chat_completions(self, request)

    def encode(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON can carry lone surrogates ("\ud800"), which are not text
            raise BadRequest(f"prompt is not valid Unicode: {e.reason} at character {e.start}") from None
        return self.tokenizer.encode(text)

    async def update_weights(self, request: web.Request):
        if self.admin is None:
            return _error(
                403, "weight updates are disabled: start the server with --admin-key-file or RLKJAX_ADMIN_KEY"
            )
        refused = self.admin.check(request)
        if refused is not None:
            return refused
        body = _fields(await _json(request, self.config.read_timeout), {"path"}, {"path"})
        if not isinstance(body["path"], str):
            raise BadRequest("path must be a string")
        params = await asyncio.to_thread(self._load_update, body["path"])
        swapped = self.engine.update_weights(params)
        self._kick()
        while not swapped.is_set():  # polled, not a blocked thread: a shutdown must not wait on it
            if self.deadline_passed:
                raise ShuttingDown("the server shut down before the new weights went live")
            await asyncio.sleep(0.02)
        return _json_response({"policy_version": self.engine.policy_version})

    def _load_update(self, path: str):
        """New weights for the served model, or BadRequest naming why not; the old weights stay.
        Refused: anything but a checkpoint directory (a preset name would build a random model), a
        checkpoint that does not load (corrupt safetensors or config.json, extra or missing
        tensors), other shapes, another dtype (float32 weights served in bfloat16's place would
        break sampler == learner), and non-finite values."""
        try:
            is_dir = Path(path).is_dir()
        except OSError as e:  # a name longer than the file system allows, say: the client's path, not a 500
            raise BadRequest(f"path {shown(path)}: {e.strerror}") from None
        if not is_dir:
            raise BadRequest(
                f"path {shown(path)} is not a checkpoint directory (HF: config.json + *.safetensors, or orbax: "
                "config.json + params/)"
            )
        try:
            cfg, params = load_model(path)
        except Exception as e:  # whatever a damaged upload raises is the caller's input problem, not a 500
            raise BadRequest(f"cannot load {shown(path)}: {type(e).__name__}: {e}") from None
        if cfg.replace_dtype(self.cfg.dtype) != self.cfg:
            raise BadRequest(f"checkpoint shapes {cfg} do not match the served model {self.cfg}")
        if cfg.dtype != self.cfg.dtype or any(
            leaf.dtype != jnp.dtype(self.cfg.dtype) for leaf in jax.tree.leaves(params)
        ):
            raise BadRequest(
                f"checkpoint dtype {cfg.dtype} is not the served dtype {self.cfg.dtype}: cast it when saving"
            )
        bad = _non_finite(params)
        if bad:
            raise BadRequest(f"checkpoint has non-finite values in {', '.join(bad[:10])}")
        return params

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

    def collect(self):
        """Prometheus collector: read the engine's counters at scrape time."""
        m = self.engine.metrics()
        uptime = max(time.time() - self.started, 1e-9)
        for name, value, doc in [
            (
                "rlkjax_requests_total",
                m["requests"],
                "requests submitted to the engine (= finished + cancelled + failed at rest)",
            ),
            (
                "rlkjax_requests_finished_total",
                m["finished"],
                "requests whose every sample stopped or reached its length",
            ),
            (
                "rlkjax_requests_cancelled_total",
                m["cancelled"],
                "requests cancelled: client gone, timeout, refused, shutdown",
            ),
            ("rlkjax_requests_failed_total", m["failed"], "requests failed by an engine error"),
            ("rlkjax_generated_tokens_total", m["decode_tokens"], "tokens sampled"),
            ("rlkjax_prefill_tokens_total", m["prefill_tokens"], "prompt tokens prefilled"),
            ("rlkjax_tokens_per_second", m["decode_tokens"] / uptime, "sampled tokens per second since start"),
            ("rlkjax_queue_depth", m["queue_depth"], "sequences waiting for admission"),
            ("rlkjax_running_sequences", m["running"], "sequences in flight"),
            ("rlkjax_kv_pages_used", m["pages_used"], "KV pages in use"),
            ("rlkjax_kv_pages_total", m["pages_total"], "KV pages available"),
            ("rlkjax_preemptions_total", m["preemptions"], "sequences preempted for pages"),
            ("rlkjax_compiled_shapes", m["compiled_shapes"], "step-function shapes compiled (one compilation each)"),
            ("rlkjax_policy_version", m["policy_version"], "weights version"),
            ("rlkjax_engine_steps_total", m["steps"], "scheduling steps (one decode round and/or prefill chunk each)"),
            ("rlkjax_engine_step_seconds_total", m["step_s"], "seconds the engine spent in scheduling steps"),
            ("rlkjax_engine_wait_seconds_total", m["wait_s"], "of those, blocked on a decode round"),
            ("rlkjax_engine_gap_seconds_total", m["gap_s"], "from reading a decode round to dispatching the next"),
            ("rlkjax_engine_dispatch_seconds_total", m["dispatch_s"], "inside the jitted calls' dispatch"),
        ]:
            yield GaugeMetricFamily(name, doc, value=value)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._track, _errors])
        app.add_routes(
            [
                web.post("/generate", self.generate),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
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
                    self._kick()
                if now >= cut_at + self.grace:
                    log.warning(
                        "exiting with %d requests and %d handlers unfinished", len(self.pending()), self.handlers
                    )
                    return
            await asyncio.sleep(0.05)


async def serve(server: Server) -> None:
    config = server.config
    # handler_cancellation: a client that disconnects cancels its handler, which cancels its sequences.
    # shutdown_timeout: the drain has waited for the handlers already; what is left is not worth a longer wait
    runner = LimitedRunner(
        server.app(),
        max_connections=config.max_connections,
        header_timeout=config.header_timeout,
        handler_cancellation=True,
        handle_signals=False,
        shutdown_timeout=SECOND_SIGNAL_GRACE_S,
    )
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.on_signal)
    log.info(
        "listening on http://%s:%d for %s (%s numerics)%s",
        config.host,
        config.port,
        config.model,
        config.numerics,
        f"; ready once {len(server.warm_up_todo)} shapes are compiled" if server.warm_up_todo else "",
    )
    try:
        await server.wait_until_drained()
    finally:
        await runner.cleanup()


def main(config: ServerConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    compilation_cache.enable(config.compilation_cache)  # before the first compilation (loading checks weights)
    asyncio.run(serve(Server(config)))


if __name__ == "__main__":
    main(tyro.cli(ServerConfig, description=__doc__))
