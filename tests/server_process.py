"""A `python -m serve.rollout` server started for real on loopback, and reading its metrics and raw
responses, for the tests that talk to one (not a test module: test modules import this, never each other)."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import jax

from rlkjax.client import RolloutClient, RolloutError
from rlkjax.engine.config import EngineConfig
from tests.helpers import ENGINE

ADMIN = "test-admin-key"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(config: EngineConfig) -> list[str]:
    """serve.rollout's flags for an engine of this config."""
    fields = ("num_pages", "max_batch", "prefill_chunk", "token_budget", "max_context", "decode_steps")
    return [arg for f in fields for arg in (f"--{f.replace('_', '-')}", str(getattr(config, f)))]


def launch(*flags):
    """The server in a subprocess, not waited for; its log goes to a file (proc.log), not a pipe nobody
    reads, whose full buffer would block the server mid-test once it has logged 64 KiB of access lines.
    Its engine is tests.helpers.ENGINE (flags may change it), so it compiles the programs the in-process
    engines compile; it shares this test run's compilation cache (conftest.py), and the executable cache
    beside it with the run's other servers, unless flags name another."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="rlkjax-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "serve.rollout",
            "--port",
            str(port),
            *engine_flags(ENGINE),
            "--no-warmup",  # test_warm_up_before_serving turns it on
            "--compilation-cache",
            jax.config.jax_compilation_cache_dir or "off",
            *flags,
        ],
        env=os.environ | {"RLKJAX_ADMIN_KEY": ADMIN},
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    proc.log = log.name
    return proc, RolloutClient(f"http://127.0.0.1:{port}", admin_key=ADMIN, timeout=600)


def start_server(*flags):
    """`launch`, then wait until /health says ready (through its 503s while it warms up)."""
    proc, client = launch(*flags)
    for _ in range(3000):
        try:
            client.health()
            return proc, client
        except (OSError, RolloutError) as e:  # not listening yet, or 503 while it warms up
            if isinstance(e, RolloutError) and e.status != 503:
                raise
            if proc.poll() is not None:
                raise RuntimeError(open(proc.log).read()) from None
            time.sleep(0.2)
    raise TimeoutError("server did not start")


def metric(client, name: str) -> float:
    return next(float(line.split()[-1]) for line in client.metrics().splitlines() if line.startswith(name + " "))


def wait_for_metric(client, name: str, at_least: float, timeout: float = 300):
    """Poll /metrics instead of sleeping a fixed time: a slow machine must not change what a test checks."""
    deadline = time.time() + timeout
    while metric(client, name) < at_least:
        assert time.time() < deadline, f"{name} did not reach {at_least} within {timeout} s"
        time.sleep(0.05)


def post_raw(client, path, data: bytes, headers=None):
    req = urllib.request.Request(
        client.url + path, data=data, headers={"Content-Type": "application/json"} | (headers or {}), method="POST"
    )
    try:
        # as long as the client's: a request that needs a program no earlier request ran waits for its
        # compilation, over a minute on a loaded 2-core machine
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
