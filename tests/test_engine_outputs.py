"""The engine's one way out, its requests' output queues (rlkjax.engine.outputs): every token once, in order, a
round at a time, then the request's end; `Engine.stop` ending one sample as a stop string does; what crosses
the threads frozen, a request's record written on the engine's thread alone; and, against a real server in
this process on loopback, no function of serve/ running on the engine thread while the detokeniser and the
stop strings run on the event loop."""

import asyncio
import dataclasses
import json
import threading
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestServer

from rlkjax.engine.engine import Engine
from rlkjax.engine.outputs import OutputQueue, RequestEnd, SampleOutput
from serve.config import ServerConfig
from serve.server import Server
from tests.helpers import ENGINE, assert_bits_equal

pytestmark = pytest.mark.slow  # compiles the engine's step functions (those of tests.helpers.ENGINE)

ROOT = Path(__file__).resolve().parent.parent


def on_another_thread(fn):
    """fn() run on a new thread: the exception it raised, or None."""
    raised = []

    def run():
        try:
            fn()
        except BaseException as e:  # handed back to the test
            raised.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return raised[0] if raised else None


def test_the_queue_hands_out_every_token_once_and_a_stop_ends_one_sample(tiny):
    """A request followed through its queue: each sample's outputs join into its completion, in order, the
    engine's finish reason in its last one, and the RequestEnd comes last, holding the completions. Stopping
    sample 1 once it has 5 tokens (what a stop string found in its text asks for) ends it with finish reason
    "stop" and a prefix of its free run's tokens and logprob bits; the others run to their length with the
    bits of a run nobody followed. The outputs are frozen, and a request's record written from a thread that
    is not the engine's fails (the bug: a field of the server's state written from two threads)."""
    cfg, params = tiny
    plain = Engine(params, cfg, "strict", ENGINE)
    free = plain.submit([5, 6, 7], n=3, max_tokens=10, seed=3)
    plain.run_until_done()

    engine = Engine(params, cfg, "strict", ENGINE)
    req = engine.submit([5, 6, 7], n=3, max_tokens=10, seed=3, outputs=OutputQueue(rounds=True))
    seen, items = {j: [] for j in range(3)}, []
    while engine.busy:
        engine.step()
        for item in req.outputs.drain():
            items.append(item)
            if isinstance(item, SampleOutput):
                before = len(seen[item.index])
                seen[item.index] += item.tokens
                if item.index == 1 and before < 5 <= len(seen[1]):
                    engine.stop(req, 1)
    end = items[-1]
    assert isinstance(end, RequestEnd) and end.request == req.id and end.error is None
    assert list(end.results) == req.results and not any(isinstance(i, RequestEnd) for i in items[:-1])
    stopped = req.results[1]
    assert stopped.finish_reason == "stop" and 5 <= len(stopped.tokens) < 10
    assert stopped.tokens == free.results[1].tokens[: len(stopped.tokens)] == seen[1]
    assert_bits_equal(stopped.logprobs, free.results[1].logprobs[: len(stopped.tokens)], "stopped sample")
    for j in (0, 2):
        outs = [i for i in items if isinstance(i, SampleOutput) and i.index == j]
        assert req.results[j].tokens == free.results[j].tokens == seen[j]
        assert [o.finish_reason for o in outs] == [None] * (len(outs) - 1) + ["length"]
        got = np.concatenate([o.logprobs for o in outs])
        assert_bits_equal(got, free.results[j].logprobs, f"sample {j}, its outputs")
        assert_bits_equal(req.results[j].logprobs, free.results[j].logprobs, f"sample {j}")
    assert engine.metrics()["pages_used"] == 0

    out = items[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.tokens = ()
    with pytest.raises(ValueError, match="read-only"):
        out.logprobs[0] = 0.0
    error = on_another_thread(lambda: setattr(req, "cancelled", True))
    assert isinstance(error, AssertionError) and "engine's thread" in str(error), error
    assert on_another_thread(lambda: engine.cancel(req)) is None  # queued for the engine's next step
    engine.step()
    assert not req.cancelled, "a request that ended keeps its final record"


class ThreadsSeen:
    """A profiler hook on every thread: (thread name, file, function) of each call into serve/ and rlkjax/engine/."""

    def __init__(self):
        self.seen: set[tuple[str, str, str]] = set()
        self.files: dict[str, str | None] = {}

    def file(self, name: str) -> str | None:
        if name not in self.files:
            try:
                rel = str(Path(name).resolve().relative_to(ROOT))
            except ValueError:
                rel = None
            self.files[name] = rel if rel and rel.startswith(("serve/", "rlkjax/engine/")) else None
        return self.files[name]

    def __call__(self, frame, event, arg):
        if event == "call" and (f := self.file(frame.f_code.co_filename)) is not None:
            self.seen.add((threading.current_thread().name, f, frame.f_code.co_name))


def test_no_serve_code_runs_on_the_engine_thread(tiny):
    """During real requests on loopback (a completion with a stop string, plain and streamed, and a streamed
    chat completion with tools), no function of serve/ runs on the engine's thread, which runs the engine's
    step; the detokeniser (serve/text.py) and `Engine.stop` run on the event loop's thread only. The stop
    string cuts the text where it first appears, streamed or not."""
    server = Server(ServerConfig(warmup=False, engine=ENGINE))
    body = {"prompt": "abc", "max_tokens": 12, "seed": 2}  # random weights write "4Yu@" in 12 tokens
    chat = {"messages": [{"role": "user", "content": "6 times 7?"}], "max_tokens": 8, "seed": 2, "stream": True}
    chat["tools"] = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]

    async def post(session, url, payload):
        async with session.post(url, json=payload) as response:
            assert response.status == 200, await response.text()
            return await (response.json() if not payload.get("stream") else response.read())

    async def run():
        async with TestServer(server.app()) as ts, aiohttp.ClientSession() as session:
            completions, chats = str(ts.make_url("/v1/completions")), str(ts.make_url("/v1/chat/completions"))
            text = (await post(session, completions, body))["choices"][0]["text"]  # compiles
            stop = next(c for c in text[1:] if c != "\ufffd")  # its first occurrence cuts the text
            hook = ThreadsSeen()
            threading.setprofile_all_threads(hook)
            try:
                plain = await post(session, completions, body | {"stop": [stop]})
                streamed = await post(session, completions, body | {"stop": [stop], "stream": True})
                await post(session, chats, chat)
            finally:
                threading.setprofile_all_threads(None)
            return text, stop, plain, streamed, hook.seen

    text, stop, plain, streamed, seen = asyncio.run(run())
    choice = plain["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == text[: text.index(stop)], (choice, text)
    pieces = [line[6:] for line in streamed.decode().split("\n") if line.startswith("data: {")]
    chunks = [c for p in pieces for c in json.loads(p)["choices"]]
    assert "".join(c["text"] for c in chunks) == choice["text"] and chunks[-1]["finish_reason"] == "stop"

    on_engine = {(f, fn) for t, f, fn in seen if t == "engine"}
    assert ("rlkjax/engine/engine.py", "step") in on_engine
    assert not {f for f, _ in on_engine if f.startswith("serve/")}, sorted(on_engine)
    loop = threading.main_thread().name  # asyncio.run's loop runs here
    assert {t for t, f, _ in seen if f == "serve/text.py"} == {loop}
    assert {t for t, f, fn in seen if (f, fn) == ("rlkjax/engine/engine.py", "stop")} == {loop}
