"""The rollout server (`python -m serve.rollout`): the engine behind an HTTP server, its routes and its drain.

Endpoints (JSON in and out; errors are 4xx with OpenAI's {"error": {"message", "type", "param", "code"}}
and the server keeps serving; a request without a seed gets a fresh one, reported as "seed"):
  POST /generate         token ids in; per sample: tokens, logprobs, finish_reason, policy_version (a sampled
                         eos of the tokenizer ends a sample and is its last token, unless ignore_eos)
  POST /v1/completions, POST /v1/chat/completions
                         OpenAI-compatible (serve/openai_api.py; docs/serving.md lists the fields),
                         streaming or not, using the model's tokenizer and chat template
  POST /inference/v1/generate
                         vLLM's token route (serve/token_route.py, as /generate): token ids and sampling_params in; per
                         sample token ids, logprobs as {"token": "token_id:<id>", "logprob"}, finish_reason
  POST /update_weights   {"path": checkpoint dir}; needs `Authorization: Bearer <admin key>`;
                         swapped between engine steps once in-flight sequences finish
  POST /v1/load_lora_adapter
                         vLLM's {"lora_name", "lora_path": PEFT dir}, with --lora-adapter: swaps the served adapter as
                         /update_weights swaps weights (serve/adapters.py)
  GET  /v1/models       the served model (OpenAI list shape, with vLLM's max_model_len), and its LoRA adapter
  GET  /health           200 {"status": "ok"} once ready; while the warm-up compiles, 503 {"status": "starting",
                         "progress": "k/N shapes compiled"} (generation routes: 503 with Retry-After); once a
                         shutdown began, 503 {"status": "draining"}
  GET  /metrics          Prometheus text format
Optional fields may be absent or null (= the default).

HTTP stack: aiohttp. One mature, asyncio-native package gives the server with request-size limits. A route
reads its body into a typed request (serve/protocol.py) and talks to the engine only through the engine
client (serve/engine_client.py), which runs the engine in one background thread and resolves each
request's future through the event loop. Every request ends once (finished, cancelled or failed: /metrics
counts each), and a shutdown drains for at most --shutdown-timeout plus a short grace, whatever the clients
or the engine do (Server.on_signal). Logprobs are JSON doubles written by Python's shortest round-trip repr,
so float32(json value) has the sampler's bits.
"""

# This file is the Server: the routes and the drain. Its flags live in serve/config.py, listening and signals in
# serve/lifecycle.py, the engine and what is in flight in serve/engine_client.py, the request bodies in
# serve/protocol.py, the routes in serve/token_route.py, serve/openai_api.py and serve/weights.py, /metrics in
# serve/metrics.py.

import asyncio
import functools
import logging
import math
import os
import sys
import time

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from rlkjax.core.checkpoint import load_model
from rlkjax.engine.engine import Engine
from rlkjax.entry_config import exit_plainly, refusing
from rlkjax.text.chat import load_chat_template
from rlkjax.text.tokenizer import load_tokenizer
from serve import adapters, openai_api, token_route, weights
from serve.auth import AdminAuth
from serve.config import ServerConfig, admin_key
from serve.engine_client import EngineClient
from serve.http import error_middleware, json_response
from serve.lifecycle import SECOND_SIGNAL_GRACE_S, SHUTDOWN_GRACE_S, serve
from serve.metrics import EngineMetrics

log = logging.getLogger("serve.rollout")


class Server:
    def __init__(self, config: ServerConfig):
        self.config = config
        with refusing():  # what the flags name: the admin key file, the model and its tokenizer
            key = admin_key(config)
            cfg, params = load_model(config.source.model, seed=config.seed)
            if config.lora_adapter is not None:
                cfg, params = adapters.adapted(cfg, params, config.lora_adapter)
            bad = weights.non_finite(params)
            if bad:
                raise ValueError(
                    f"--model {config.source.model}: non-finite values in {', '.join(bad[:10])}; refusing to serve them"
                )
            tokenizer = load_tokenizer(config.source.model, config.source.tokenizer)
            template = load_chat_template(tokenizer)
        self.admin = AdminAuth(key) if key else None
        self.adapter = None if config.lora_adapter is None else adapters.Served.at_start(config.lora_adapter)
        eos = tokenizer.eos_token_id  # the one eos policy (SamplingParams.stop_ids) applies on every route
        eos = eos if eos is not None and eos < cfg.vocab_size else None
        engine = Engine(params, cfg, config.runtime.numerics, config.engine, eos_token_id=eos)
        self.client = EngineClient(
            engine,
            tokenizer,
            template,
            max_prompts=config.max_prompts,
            max_sequences=config.max_sequences,
            warmup=config.warmup,
        )
        self.deadline = math.inf
        self.grace = SHUTDOWN_GRACE_S  # after the deadline's cancellations, for the handlers to answer
        self.handlers = 0  # route handlers running (a stream until its last event): the drain waits for them
        self.started = time.time()
        self.registry = CollectorRegistry()
        self.registry.register(EngineMetrics(self.client, self.started))

    # ----- routes -----
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._track, error_middleware])
        client, config = self.client, self.config
        app.add_routes(
            [
                web.post("/generate", functools.partial(token_route.generate, client, config)),
                web.post("/v1/completions", functools.partial(openai_api.completions, client, config)),
                web.post("/v1/chat/completions", functools.partial(openai_api.chat_completions, client, config)),
                web.post("/inference/v1/generate", functools.partial(token_route.generate_tokens, client, config)),
                web.post("/update_weights", functools.partial(weights.update_weights, client, self.admin, config)),
                *adapters.routes(client, self.admin, config, self.adapter),
                web.get("/health", self.health),
                web.get("/v1/models", self.models),
                web.get("/metrics", self.metrics),
            ]
        )
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._shutdown)
        return app

    async def models(self, request):
        """GET /v1/models: the served model in OpenAI's list shape, then its LoRA adapter if one is served (vLLM's
        card for a loaded adapter: "parent" the base, "root" the adapter's directory)."""
        card = {
            "id": self.config.source.model,
            "object": "model",
            "created": int(self.started),
            "owned_by": "rlkjax",
            "policy_version": self.client.policy_version,
            "max_model_len": self.client.max_context,
        }
        cards = [card]
        if self.adapter is not None:
            cards.append(card | {"id": self.adapter.name, "parent": card["id"], "root": self.adapter.path})
        return json_response({"object": "list", "data": cards})

    async def health(self, request):
        """ok (200); starting (503, with progress) until warmed up; draining (503) once a shutdown began, so a
        load balancer stops sending."""
        version = self.client.policy_version
        if self.client.draining:
            return json_response({"status": "draining", "policy_version": version}, status=503)
        if not self.client.ready.is_set():
            body = {"status": "starting", "progress": self.client.progress(), "policy_version": version}
            return json_response(body, status=503)
        return json_response({"status": "ok", "policy_version": version})

    async def metrics(self, request):
        return web.Response(body=generate_latest(self.registry), content_type="text/plain", charset="utf-8")

    # ----- lifecycle -----
    @web.middleware
    async def _track(self, request, handler):
        """Count running handlers, so a shutdown waits for their answers (and only for a bounded time)."""
        self.handlers += 1
        try:
            return await handler(request)
        finally:
            self.handlers -= 1

    async def _startup(self, app):
        self.client.start()

    async def _shutdown(self, app):
        await self.client.stop(self.grace)

    def on_signal(self):
        """First signal: drain (/health 503, new work 503) until idle or --shutdown-timeout. Another: cancel what
        is left now and give its handlers a moment to answer."""
        if self.client.draining:
            log.info("second signal: cancelling what is still in flight and exiting")
            self.deadline, self.grace = min(self.deadline, time.monotonic()), SECOND_SIGNAL_GRACE_S
            return
        log.info("signal: draining for up to %.0f s", self.config.shutdown_timeout)
        self.client.drain()
        self.deadline = time.monotonic() + self.config.shutdown_timeout

    async def wait_until_drained(self):
        """Return once a signal came and every request has ended and been answered; at the deadline, cancel
        what is left (its handlers answer 503) and return once answered, or `grace` seconds later regardless:
        a request whose handler is gone, or a handler that cannot finish, never holds the process."""
        cut_at, client = None, self.client
        while not client.draining or client.pending() or self.handlers:
            if client.failure is not None:
                raise SystemExit(f"warm-up failed: {type(client.failure).__name__}: {client.failure}")
            now = time.monotonic()
            if client.draining and now >= self.deadline:
                if cut_at is None:
                    cut_at = now
                    client.cut()
                if now >= cut_at + self.grace:
                    log.warning(
                        "exiting with %d requests and %d handlers unfinished", len(client.pending()), self.handlers
                    )
                    return
            await asyncio.sleep(0.05)

    def warm_up_shapes(self) -> int:
        """Shapes the engine compiles before it serves (0: ready at once)."""
        return len(self.client.warm_up_todo)


def main(config: ServerConfig) -> None:
    """Serve until a signal. A start refused (the admin key file, a missing or malformed model or tokenizer, a port
    that cannot be listened on) prints its message and exits with status 2 (rlkjax/entry_config.py exit_plainly)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    with exit_plainly("serve.rollout"):
        config.runtime.enable_compilation_cache()  # before the first compilation (loading checks the weights)
        server = Server(config)
        asyncio.run(serve(server))
    if not server.client.stopped():
        # A shutdown cut the engine's step short. Finalising the interpreter while that thread is still
        # inside XLA can abort the process (SIGABRT, seen under load); every answer has been sent, so the
        # process leaves without finalising, with exit status 0.
        log.info("exiting while the engine thread finishes its step")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
