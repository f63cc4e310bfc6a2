"""Every request the server takes ends, whatever happens to it, and /metrics proves it; a shutdown
after faulty traffic is clean and bounded; an error in the middle of a stream still ends the stream
with [DONE]. Against the real server on loopback (a subprocess, or in this process where the test must
reach the engine)."""

import asyncio
import concurrent.futures
import json
import signal
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

import rlkjax
from serve.config import ServerConfig
from serve.lifecycle import SHUTDOWN_GRACE_S
from serve.server import Server
from tests import fault_load
from tests.helpers import ENGINE
from tests.server_process import ADMIN, post_raw, start_server, wait_for_metric

pytestmark = pytest.mark.slow  # real servers, and a few hundred requests

ENDED = ("finished", "cancelled", "failed")


def wait_balanced(client, timeout: float = 60) -> dict:
    """Poll /metrics until the server is at rest: every request submitted has ended (finished, cancelled
    or failed), nothing runs or waits, no KV page is held. Returns the counters."""
    deadline = time.time() + timeout
    while True:
        text = client.metrics()
        value = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("rlkjax_")}
        counts = {k: value[f"rlkjax_requests_{k}_total"] for k in ENDED} | {"requests": value["rlkjax_requests_total"]}
        idle = (value["rlkjax_kv_pages_used"], value["rlkjax_running_sequences"], value["rlkjax_queue_depth"])
        if counts["requests"] == sum(counts[k] for k in ENDED) and idle == (0, 0, 0):
            return counts
        assert time.time() < deadline, f"not at rest after {timeout} s: {counts}, pages/running/queued {idle}"
        time.sleep(0.1)


def events(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]


def post_stream(client, body: dict) -> tuple[int, list[str]]:
    """A streamed request read to its end: (status, the data of every event)."""
    req = urllib.request.Request(
        client.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, events(r.read())
    except urllib.error.HTTPError as e:
        return e.code, [e.read().decode()]


def get_health(client) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(client.url + "/health", timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_hostile_load_ends_every_request_then_a_clean_shutdown(tiny, tmp_path):
    """240 small requests, 10% of them dropped mid-stream, 5% with a bad field (some refused only after
    their first prompt reached the engine), 5% with a 1 ms timeout, and a weight update after a third:
    each client gets the answer of its kind (no 500, every stream ends with [DONE]), and then the
    counters balance with no page held (requests cancelled before their forks started used to stay
    "submitted, never finished" forever, and a drain waiting on them never ended). Then SIGTERM with
    in-flight work: /health says draining (503), the work is cut at --shutdown-timeout with a 503 (a
    stream: its error event, then [DONE]), and the process exits 0 soon after."""
    cfg, _ = tiny
    rlkjax.save_hf_checkpoint(tmp_path / "v1", cfg, rlkjax.init_params(cfg, seed=1))
    proc, client = start_server("--shutdown-timeout", "2")
    try:
        outcomes, (status, update) = asyncio.run(fault_load.run(client.url, ADMIN, str(tmp_path / "v1"), 240))
        assert status == 200 and update["policy_version"] == 1, update
        expected = {
            "plain:200",
            "stream:200:ok:done",
            "disconnected",
            "bad:400",
            "timeout:408",  # a plain response
            "timeout:200:error:done",  # a stream: the error event, then [DONE]
        }
        assert set(outcomes) <= expected, outcomes
        assert outcomes["disconnected"] and outcomes["bad:400"] and outcomes["timeout:408"], outcomes
        counts = wait_balanced(client)
        assert counts["cancelled"] >= outcomes["disconnected"] and counts["failed"] == 0, counts

        stream = {"prompt": "x" * 8, "n": 2, "max_tokens": 240, "seed": 0, "stream": True}
        plain = json.dumps({"prompt": [1, 2, 3], "n": 4, "max_new_tokens": 240, "seed": 0}).encode()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            streamed = pool.submit(post_stream, client, stream)
            answered = pool.submit(post_raw, client, "/generate", plain)
            wait_for_metric(client, "rlkjax_running_sequences", 6)
            signalled = time.time()
            proc.send_signal(signal.SIGTERM)
            assert get_health(client) == (503, {"status": "draining", "policy_version": 1})
            code, body = answered.result()
            assert code == 503 and "--shutdown-timeout" in body["error"]["message"], (code, body)
            code, data = streamed.result()
            assert code == 200 and data[-1] == "[DONE]", data[-3:]
            error = json.loads(data[-2])["error"]
            assert error["type"] == "server_error" and "--shutdown-timeout" in error["message"], error
        assert proc.wait(timeout=60) == 0
        took = time.time() - signalled
        assert took < 2 + SHUTDOWN_GRACE_S + 5, f"exited {took:.1f} s after SIGTERM with --shutdown-timeout 2"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_engine_failure_ends_requests_with_an_error_and_streams_with_done(tiny):
    """A step that raises (here the engine's weights taken away under its running requests) fails every
    request the engine held: a plain request gets a 500 naming the failure, a stream its error event and
    then [DONE]; they count as failed, no page stays held, and the server serves the next request."""
    server = Server(ServerConfig(warmup=False, engine=ENGINE))

    async def run():
        async with TestServer(server.app()) as ts, aiohttp.ClientSession() as session:
            url = str(ts.make_url("/v1/completions"))
            body = {"prompt": "abc", "max_tokens": 200, "seed": 1}
            async with session.post(url, json=body | {"stream": True}) as stream:
                first = await stream.content.readline()  # the stream has started: its sequence runs
                plain = asyncio.ensure_future(session.post(url, json=body))
                while server.client.metrics()["running"] < 2:
                    await asyncio.sleep(0.01)
                params, server.client.engine.params = server.client.engine.params, None  # the next step raises
                rest = await stream.content.read()
            async with await plain as answer:
                failed = answer.status, await answer.json()
            server.client.engine.params = params
            async with session.post(url, json=body | {"max_tokens": 4}) as after:
                again = after.status
            return first, rest, failed, again

    first, rest, (status, failed), again = asyncio.run(run())
    data = events(first + rest)
    assert data[-1] == "[DONE]" and json.loads(data[0])["choices"], data[:1]
    error = json.loads(data[-2])["error"]
    assert error["type"] == "server_error" and "engine failed" in error["message"], error
    assert status == 500 and "engine failed" in failed["error"]["message"], failed
    assert again == 200
    m = server.client.metrics()
    assert m["failed"] == 2 and m["requests"] == sum(m[k] for k in ENDED) and m["pages_used"] == 0, m
