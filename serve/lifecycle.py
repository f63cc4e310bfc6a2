"""Running a Server: listen, turn SIGTERM/SIGINT into its drain, and close the listener once it has drained
(the drain itself, Server.on_signal and Server.wait_until_drained, reads the server's request bookkeeping)."""

import asyncio
import logging
import signal

from aiohttp import web

from rlkjax.entry_config import Refusal
from serve.connections import LimitedRunner

log = logging.getLogger("serve.rollout")

# Once a shutdown cancelled what was left (deadline or second signal), how long its handlers get to answer
# before the process exits regardless: cancelled requests end at the engine's next step.
SHUTDOWN_GRACE_S, SECOND_SIGNAL_GRACE_S = 5.0, 0.5


async def serve(server) -> None:
    """Serve `server` (a serve.server.Server) on its host and port until a signal drained it."""
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
    try:
        await web.TCPSite(runner, config.host, config.port).start()
    except OSError as e:
        await runner.cleanup()
        raise Refusal(
            f"--host {config.host} --port {config.port}: cannot listen there ({e.strerror or e}); choose another "
            "--port, or stop what holds this one"
        ) from e
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.on_signal)
    log.info(
        "listening on http://%s:%d for %s (%s numerics)%s",
        config.host,
        config.port,
        config.source.model,
        config.runtime.numerics,
        f"; ready once {server.warm_up_shapes()} shapes are compiled" if server.warm_up_shapes() else "",
    )
    try:
        await server.wait_until_drained()
    finally:
        await runner.cleanup()
