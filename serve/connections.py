"""Connection-level limits of the HTTP server, against slow or numerous clients.

- Header timeout: a connection must deliver a complete request head within `header_timeout` seconds
  of opening, or of the end of its previous response; otherwise it is closed. aiohttp arms its
  keep-alive timer when a connection opens and again after each response, and closes the connection
  when the timer fires while no request head has arrived, so its `keepalive_timeout` is exactly this
  deadline (a request being read or handled is not affected; its body has --read-timeout). Without it a
  client trickling header bytes held its connection for aiohttp's default of an hour.
- Connection cap: past `max_connections` open connections a new one is answered 503 (OpenAI's error
  shape, Retry-After) and closed, before any of its bytes are parsed, so a flood of connections costs
  the server a socket each for a moment, not a handler and its buffers.
"""

import asyncio
import json
import logging

from aiohttp import web

log = logging.getLogger("serve.rollout")

LINGER_S = 2.0  # a refused client may still be sending its request: read and drop it this long, then close


def _refusal(max_connections: int) -> bytes:
    message = f"the server has {max_connections} connections open, its limit (--max-connections); retry shortly"
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": None}}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class _Refuse(asyncio.Protocol):
    """One refused connection: the 503 is written at once and the write side shut; what the client
    still sends is read and dropped until it closes or LINGER_S pass. Closing with its request
    unread would reset the connection, and the client could lose the 503 before reading it."""

    def __init__(self, response: bytes):
        self.response = response
        self.timer = None

    def connection_made(self, transport):
        transport.write(self.response)
        if transport.can_write_eof():
            transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def data_received(self, data):
        pass  # the request is not read: it gets the 503 whatever it is

    def connection_lost(self, exc):
        if self.timer is not None:
            self.timer.cancel()


class _LimitedServer(web.Server):
    """aiohttp's connection manager, counting connections from the moment their protocol is made
    (a burst of accepts makes many protocols before any of them reports its connection) until
    aiohttp reports them lost, and refusing new ones past the limit."""

    def __init__(self, *args, max_connections: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_connections = max_connections
        self.open, self.refused = 0, 0
        self.refusal = _refusal(max_connections)

    def __call__(self):
        if self.open >= self.max_connections:
            self.refused += 1
            if self.refused & (self.refused - 1) == 0:  # at powers of two: a flood cannot fill the log
                log.warning("refused a connection: %d open (--max-connections); %d refused", self.open, self.refused)
            return _Refuse(self.refusal)
        handler = super().__call__()
        self.open += 1
        return handler

    def connection_lost(self, handler, exc=None):
        self.open -= 1  # aiohttp's handler reports its loss once, and only after a connection was made
        super().connection_lost(handler, exc)


class LimitedRunner(web.AppRunner):
    """web.AppRunner whose server applies the two limits above; other keyword arguments are aiohttp's."""

    def __init__(self, app: web.Application, *, max_connections: int, header_timeout: float, **kwargs):
        super().__init__(app, keepalive_timeout=header_timeout, **kwargs)
        self.max_connections = max_connections

    async def _make_server(self) -> web.Server:
        # The app's own server, rebuilt as a _LimitedServer with the same handler and settings
        # (aiohttp 3.14 offers no hook to choose the server class; the version is pinned).
        server = await super()._make_server()
        return _LimitedServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            max_connections=self.max_connections,
            **server._kwargs,
        )
