"""The server's connection-level limits (serve/connections.py) on loopback with real sockets, in
front of a one-route app so each test takes about a second: a client trickling its headers is cut
off after the header timeout, a request in progress is not, and past the connection cap a new
connection gets a 503 it can read, while a freed slot is usable again."""

import asyncio
import json
import logging
import time

from aiohttp import web

from serve.connections import LimitedRunner


async def _serving(max_connections=100, header_timeout=0.5, handler=None):
    async def hello(request):
        await request.read()
        return web.json_response({"ok": True})

    app = web.Application()
    app.add_routes([web.post("/", handler or hello)])
    runner = LimitedRunner(app, max_connections=max_connections, header_timeout=header_timeout)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site.port


async def _request(port, body=b"{}"):
    """One POST on a fresh connection -> (status line, JSON body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    reply = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), json.loads(payload)


def test_a_client_trickling_its_headers_is_closed_after_the_header_timeout():
    """One header byte every 0.1 s: aiohttp's default would hold the connection an hour (a few
    hundred such clients held a server's connections for as long as they liked)."""

    async def main():
        runner, port = await _serving(header_timeout=0.5)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            start, closed_after = time.monotonic(), None
            for byte in b"POST / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                try:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    if await asyncio.wait_for(reader.read(1), 0.1) == b"":
                        closed_after = time.monotonic() - start
                        break
                except TimeoutError:
                    continue
                except ConnectionError:
                    closed_after = time.monotonic() - start
                    break
            writer.close()
            assert closed_after is not None and 0.4 < closed_after < 3, closed_after
            assert (await _request(port))[0] == "HTTP/1.1 200 OK"  # others are served meanwhile
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_the_header_timeout_does_not_cut_a_request_being_handled():
    """A handler that takes 4x the header timeout still answers: the deadline is for the head only."""

    async def slow(request):
        await asyncio.sleep(1.2)
        return web.json_response({"ok": True})

    async def main():
        runner, port = await _serving(header_timeout=0.3, handler=slow)
        try:
            assert await _request(port) == ("HTTP/1.1 200 OK", {"ok": True})
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_connections_past_the_cap_get_a_503_and_a_freed_slot_serves_again():
    """Three idle connections fill a cap of 3, opened at once (a burst of accepts makes every
    protocol before any reports its connection, so the count starts at the protocol). The fourth
    reads a 503 in OpenAI's error shape; once one idle connection closes, a request is served."""

    async def main():
        runner, port = await _serving(max_connections=3, header_timeout=30)
        try:
            idle = await asyncio.gather(*[asyncio.open_connection("127.0.0.1", port) for _ in range(3)])
            status, payload = await _request(port)
            assert status == "HTTP/1.1 503 Service Unavailable", status
            assert "--max-connections" in payload["error"]["message"] and payload["error"]["type"] == "server_error"
            idle[0][1].close()
            await idle[0][1].wait_closed()
            for _ in range(50):  # the server sees the close on its next loop turn
                status, payload = await _request(port)
                if status != "HTTP/1.1 503 Service Unavailable":
                    break
                await asyncio.sleep(0.02)
            assert (status, payload) == ("HTTP/1.1 200 OK", {"ok": True})
            for _, writer in idle[1:]:
                writer.close()
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_a_burst_of_connections_is_capped_exactly(caplog):
    """40 clients connect at once against a cap of 10: exactly 10 are served (each handler waits
    until all have connected, so none frees its slot early) and 30 read a 503. The log counts the
    refusals at powers of two (1, 2, 4, 8, 16), not one line each."""

    async def main():
        gate = asyncio.Event()

        async def held(request):
            await gate.wait()
            return web.json_response({"ok": True})

        runner, port = await _serving(max_connections=10, header_timeout=30, handler=held)
        try:
            tasks = [asyncio.create_task(_request(port)) for _ in range(40)]
            await asyncio.sleep(1.0)
            gate.set()
            statuses = [status for status, _ in await asyncio.gather(*tasks)]
            assert statuses.count("HTTP/1.1 200 OK") == 10, statuses
            assert statuses.count("HTTP/1.1 503 Service Unavailable") == 30, statuses
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.WARNING, logger="serve.rollout"):
        asyncio.run(main())
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused a connection")]
    assert [int(line.rsplit("; ", 1)[1].split()[0]) for line in refusals] == [1, 2, 4, 8, 16], refusals
