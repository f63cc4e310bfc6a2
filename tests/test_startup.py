"""Server start-up: it listens at once and says how far its warm-up is (503 "starting" with progress,
generation routes 503 with Retry-After) until it is ready; the persistent compilation cache makes a
restart ready sooner and serves the same bits. The cache's flag, its default place and 'off', for the
server and for train.grpo."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import rlkjax
from rlkjax.engine import compilation_cache
from rlkjax.entry_config import Runtime
from tests.helpers import assert_bits_equal
from tests.server_process import launch

REQUEST = {"prompt": [[3, 1, 4, 1, 5], [2, 7, 1]], "max_new_tokens": 6, "seed": 11}  # fits --max-batch 1


def get(url: str, body: dict | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a GET (or a POST of `body`), whatever the status."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def start_and_sample(*flags) -> dict:
    """Start a server with a warm-up of 4 shapes (max batch 1), record every /health answer until it is
    ready and what /generate said meanwhile, sample REQUEST, stop it (SIGTERM: exit 0)."""
    started = time.perf_counter()
    proc, client = launch("--warmup", "--max-batch", "1", *flags)
    answers, refused = [], None
    try:
        while True:
            try:
                status, body, _ = get(client.url + "/health")
            except OSError:  # not listening yet
                assert proc.poll() is None, open(proc.log).read()
                time.sleep(0.05)
                continue
            answers.append((status, body))
            if status == 200:
                ready_s = time.perf_counter() - started
                break
            if refused is None:
                refused = get(client.url + "/generate", REQUEST)
            time.sleep(0.05)
        samples = [s for p in client.generate(REQUEST["prompt"], max_tokens=6, seed=REQUEST["seed"]) for s in p]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    assert code == 0, open(proc.log).read()
    return dict(answers=answers, refused=refused, ready_s=ready_s, samples=samples, log=open(proc.log).read())


@pytest.mark.slow
def test_listens_while_warming_up_and_a_warm_cache_is_ready_sooner_with_the_same_bits(tiny, tmp_path):
    """The server used to compile every shape before it listened (145 s of silence at the default
    --max-batch on a busy 2-core machine), and every restart compiled them all again (or, with JAX's
    compilation cache alone, traced and lowered them all again). A warm restart loads the executables
    and serves the cold start's bits, which are the learner's."""
    cache = str(tmp_path / "jax")
    cold = start_and_sample("--compilation-cache", cache)
    starting = [body for status, body in cold["answers"] if status != 200]
    assert starting, "the cold start was ready at its first /health answer: nothing showed the warm-up"
    assert all(s == 503 for s, _ in cold["answers"][:-1]) and cold["answers"][-1][1]["status"] == "ok"
    for body in starting:
        assert body["status"] == "starting" and re.fullmatch(r"[0-3]/4 shapes compiled", body["progress"]), body
    status, body, headers = cold["refused"]
    assert status == 503 and "starting" in body["error"]["message"], body
    assert int(headers["Retry-After"]) >= 1, headers
    assert [f"warm-up {k}/4:" in cold["log"] for k in range(1, 5)] == [True] * 4, cold["log"]
    assert re.search(r"warm-up: 4 shapes compiled in .*; 0 programs from the cache, 0 executables", cold["log"])

    warm = start_and_sample("--compilation-cache", cache)
    # every step function's executable comes from disk: nothing is traced, lowered or compiled
    line = re.search(r"warm-up: 4 shapes compiled in .*", warm["log"])[0]
    assert "trace 0.0 s, lower 0.0 s, compile 0.0 s" in line and line.endswith(", 4 executables loaded)"), line
    assert warm["ready_s"] < cold["ready_s"], (warm["ready_s"], cold["ready_s"])
    cfg, params = tiny
    for prompt, a, b in zip(REQUEST["prompt"], cold["samples"], warm["samples"], strict=True):
        assert a["tokens"] == b["tokens"]
        warm_bits = np.asarray(b["logprobs"], np.float32)
        assert_bits_equal(np.asarray(a["logprobs"], np.float32), warm_bits, "warm start")
        assert_bits_equal(warm_bits, rlkjax.score(params, cfg, [prompt + b["tokens"]], [len(prompt)])[0], "learner")


def test_compilation_cache_flag(monkeypatch, tmp_path):
    """A directory or 'off'; under XDG_CACHE_HOME (else ~/.cache) by default; an empty string or a
    file is refused at start, naming the flag."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation_cache.default_dir() == str(tmp_path / "rlkjax" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compilation_cache.default_dir() == str(tmp_path / "home" / ".cache" / "rlkjax" / "jax")
    Runtime(compilation_cache="off")
    Runtime(compilation_cache=str(tmp_path / "new" / "dir"))
    (tmp_path / "file").write_text("")
    for bad in ("", str(tmp_path / "file")):
        with pytest.raises(ValueError, match="--compilation-cache"):
            Runtime(compilation_cache=bad)


COMPILE_ONE = (
    "import jax, sys; from rlkjax.engine import compilation_cache as c; c.enable(sys.argv[1]); "
    "jax.jit(jax.numpy.sin)(1.0)"
)


def test_enable_writes_the_cache_and_off_writes_nothing(tmp_path):
    """In a fresh process (JAX reads the setting at its first compilation): a directory gets the compiled
    program; 'off' writes nowhere, even where JAX_COMPILATION_CACHE_DIR points."""
    env = os.environ | {"JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "env")}
    subprocess.run([sys.executable, "-c", COMPILE_ONE, str(tmp_path / "on")], env=env, check=True, timeout=300)
    assert any(p.is_file() for p in (tmp_path / "on").rglob("*"))
    subprocess.run([sys.executable, "-c", COMPILE_ONE, "off"], env=env, check=True, timeout=300)
    assert not (tmp_path / "env").exists()


@pytest.mark.slow
def test_train_grpo_uses_the_cache_under_xdg_cache_home(tmp_path):
    """`python -m train.grpo` with no cache flag compiles into $XDG_CACHE_HOME/rlkjax/jax."""
    flags = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "2"]
    flags += ["--checkpoint-every", "0", "--no-progress", "--out", str(tmp_path / "run")]
    env = os.environ | {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    subprocess.run([sys.executable, "-m", "train.grpo", *flags], env=env, check=True, timeout=900)
    assert sum(p.is_file() for p in (tmp_path / "xdg" / "rlkjax" / "jax").rglob("*")) > 10
