"""How many of the repository's source files one `POST /v1/completions` (or, with `--chat-tools`, one
streamed `POST /v1/chat/completions` with `tools`) runs through, and how often it crosses from one to
another, from the route to the engine and back: a measure of how much code a reader must follow to change
the serving path.

Method: a real server (qwen3-tiny, no warm-up) in this process on loopback; one request compiles every
program it needs, then the same request (plain, then streamed) runs under a profiler hook on every
thread (`threading.setprofile_all_threads`, so the engine thread is seen too). Each Python call into a
function of serve/, rlkjax/ or pallas_kernels/ counts that file; when the nearest frame below it that
belongs to one of those files is in another file, the call is a hop (caller file -> callee file). Calls
that reach the repository from aiohttp or asyncio alone (the route itself, callbacks the event loop runs)
are not hops. A coroutine's resumption counts as a call (its awaiting frame is its caller). Kernels are
included in the count, and none runs: the programs were compiled by the first request, so
pallas_kernels/ code executes only when tracing. With `--chat-tools` the first, compiling request is traced
too ("first"; its kernels are traced into programs then), then the same request again ("again").

Reported: files, hops (distinct caller file -> callee file pairs; those with serve/ on either side apart),
calls across files (distinct caller function -> callee function pairs; and every call, which varies a
little from run to run with how the engine's steps fall), and two directions that point upwards: the
library calling server code (rlkjax -> serve), and the OpenAI route modules calling the Server class's
module; and the functions of serve/ that ran on the engine's thread.

    PYTHONPATH=$PWD .venv/bin/python -m bench.serve_hops [--chat-tools] [-v]
"""

import asyncio
import collections
import json
import threading
from pathlib import Path

import aiohttp
from aiohttp.test_utils import TestServer

from bench import _flags

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("serve", "rlkjax", "pallas_kernels")
SERVER_MODULES = ("serve/rollout.py", "serve/server.py")  # where the Server class lives, before and after
ROUTE_MODULES = ("serve/openai_api.py", "serve/openai_params.py", "serve/protocol.py")
BODY = {"prompt": "abc", "max_tokens": 8, "seed": 1, "logprobs": 1}
# A tool-calling agent's turn, as verifiers' harness sends it: streamed, with tools (tool_choice auto).
CHAT_TOOLS = {
    "messages": [{"role": "user", "content": "What is 6 times 7?"}],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluate an arithmetic expression.",
                "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
            },
        }
    ],
    "max_tokens": 8,
    "seed": 1,
    "logprobs": True,
    "stream": True,
}


def repo_file(filename: str, packages: tuple[str, ...] = PACKAGES) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(rel) if rel.parts and rel.parts[0] in packages else None


class Trace:
    """A profiler hook recording every call into the repository's files (those of `packages`), from any
    thread."""

    packages = PACKAGES

    def __init__(self):
        self.files: set[str] = set()
        self.calls: collections.Counter = collections.Counter()  # (caller file, fn, callee file, fn) -> count
        self.lock = threading.Lock()
        self.names: dict[str, str | None] = {}
        self.serve_on_engine_thread: set[str] = set()  # file:function of serve/ run by the thread named "engine"

    def file(self, code) -> str | None:
        name = code.co_filename
        if name not in self.names:
            self.names[name] = repo_file(name, self.packages)
        return self.names[name]

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        callee = self.file(frame.f_code)
        if callee is None:
            return
        caller = frame.f_back
        while caller is not None and self.file(caller.f_code) is None:
            caller = caller.f_back
        if callee.startswith("serve/") and threading.current_thread().name == "engine":
            with self.lock:
                self.serve_on_engine_thread.add(f"{callee}:{frame.f_code.co_name}")
        with self.lock:
            self.files.add(callee)
            if caller is not None and self.file(caller.f_code) != callee:
                key = (self.file(caller.f_code), caller.f_code.co_name, callee, frame.f_code.co_name)
                self.calls[key] += 1

    def summary(self) -> dict:
        pairs = {(a, c) for a, _, c, _ in self.calls}
        return {
            "files": len(self.files),
            "hops": len(pairs),
            "hops_to_or_from_serve": sum("serve/" in a or "serve/" in c for a, c in pairs),
            "calls_across_files": len(self.calls),
            "calls_across_files_dynamic": sum(self.calls.values()),
            "library_to_serve": sorted(
                f"{a}:{f} -> {c}:{g}" for a, f, c, g in self.calls if a.startswith("rlkjax/") and c.startswith("serve/")
            ),
            "serve_on_engine_thread": sorted(self.serve_on_engine_thread),
            "routes_to_server": sorted(
                f"{a}:{f} -> {c}:{g}" for a, f, c, g in self.calls if a in ROUTE_MODULES and c in SERVER_MODULES
            ),
            "file_list": sorted(self.files),
            "hop_list": sorted(f"{a} -> {c}" for a, c in pairs),
        }


async def post(session, url: str, body: dict) -> None:
    async with session.post(url, json=body) as response:
        text = await response.text()
        assert response.status == 200, text


def traced(request):
    """Run `request()` (a coroutine function) under the profiler hook on every thread: its Trace."""

    async def run() -> Trace:
        trace = Trace()
        threading.setprofile_all_threads(trace)
        try:
            await request()
        finally:
            threading.setprofile_all_threads(None)
        return trace

    return run()


async def measure_chat_tools(server) -> dict:
    """The streamed chat completion with tools: its first (compiling) run and the same request again."""
    async with TestServer(server.app()) as ts, aiohttp.ClientSession() as session:
        url = str(ts.make_url("/v1/chat/completions"))
        first = await traced(lambda: post(session, url, CHAT_TOOLS))
        again = await traced(lambda: post(session, url, CHAT_TOOLS))
        return {"first": first.summary(), "again": again.summary()}


async def measure(server) -> dict:
    out = {}
    async with TestServer(server.app()) as ts, aiohttp.ClientSession() as session:
        url = str(ts.make_url("/v1/completions"))
        for name, body in (("plain", BODY), ("stream", BODY | {"stream": True})):
            await post(session, url, body)  # compiles what this request runs
            trace = Trace()
            threading.setprofile_all_threads(trace)
            try:
                await post(session, url, body)
            finally:
                threading.setprofile_all_threads(None)
            out[name] = trace.summary()
    return out


def main() -> None:
    parser = _flags.parser(__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="also list the files and the hops")
    parser.add_argument(
        "--chat-tools", action="store_true", help="a streamed chat completion with tools, its compiling run included"
    )
    args = parser.parse_args()
    try:
        from serve.server import Server
    except ImportError:  # the code before serve/server.py held the Server in serve/rollout.py
        from serve.rollout import Server
    from rlkjax.engine.config import EngineConfig
    from serve.config import ServerConfig

    engine = EngineConfig(num_pages=128, max_batch=8, prefill_chunk=16, token_budget=32, max_context=256)
    server = Server(ServerConfig(warmup=False, engine=engine))
    result = asyncio.run(measure_chat_tools(server) if args.chat_tools else measure(server))
    for name, r in result.items():
        if not args.verbose:
            r = {k: v for k, v in r.items() if not k.endswith("_list")}
        print(name, json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
