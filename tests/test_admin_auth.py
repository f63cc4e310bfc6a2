"""The admin-key check (serve/auth.py) on loopback in front of a one-route app, from several source
addresses (Linux routes all of 127.0.0.0/8 to loopback): the right key is never refused, wrong keys
are counted per address, and no header bytes make it a 500."""

import asyncio
import logging

from aiohttp import web

from serve.auth import MAX_FAILURES, AdminAuth

KEY = "k" * 32


async def _post(port, authorization: bytes, source: str = "127.0.0.1") -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: %s\r\n\r\n" % authorization)
    reply = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), head + body


def _run(client):
    auth = AdminAuth(KEY)

    async def update(request):
        return auth.check(request) or web.json_response({"ok": True})

    async def main():
        app = web.Application()
        app.add_routes([web.post("/", update)])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            await client(site.port)
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_the_right_key_gets_in_after_any_number_of_wrong_ones(caplog):
    """50 wrong keys from 127.0.0.2: 401 up to the limit, then 429 with Retry-After; the right key
    from the same address is then accepted on its first try (it used to get 429 for a minute, so
    any process on the machine could lock the trainer out). 127.0.0.3's first wrong key is a 401:
    the count is per address. The log names the address and count without a line per attempt."""

    async def client(port):
        wrong = [await _post(port, b"Bearer guess-%d" % i, "127.0.0.2") for i in range(50)]
        assert [status for status, _ in wrong] == [401] * MAX_FAILURES + [429] * (50 - MAX_FAILURES)
        assert b"Retry-After: " in wrong[-1][1] and b"50 from 127.0.0.2" in wrong[-1][1]
        assert (await _post(port, b"Bearer " + KEY.encode(), "127.0.0.2"))[0] == 200
        assert (await _post(port, b"bearer " + KEY.encode(), "127.0.0.2"))[0] == 200  # RFC 7235: any case
        assert (await _post(port, b"Bearer nope", "127.0.0.3"))[0] == 401

    with caplog.at_level(logging.WARNING, logger="serve.rollout"):
        _run(client)
    lines = [r.getMessage() for r in caplog.records if "rejected admin key" in r.getMessage()]
    from_2 = [line for line in lines if line.startswith("rejected admin key from 127.0.0.2 (port ")]
    assert [int(line.split(": ")[1].split()[0]) for line in from_2] == [1, 2, 3, 4, 5, 8, 16, 32]
    assert len(lines) == len(from_2) + 1


def test_odd_authorization_headers_get_401():
    """Non-UTF-8 bytes, a missing scheme or key, another scheme: each is a wrong key (401), not a 500."""

    async def client(port):
        for header in (b"Bearer \xff\xfe", b"\xff " + KEY.encode(), b"Bearer", b"", b"Basic " + KEY.encode()):
            assert (await _post(port, header))[0] == 401, header

    _run(client)
