"""`python -m serve.rollout` started for real on loopback: exact logprobs over HTTP under 200
concurrent requests and a weight update mid-load; bad input gets a clear 4xx and the server keeps
serving; SIGTERM drains in-flight requests and exits cleanly."""

import concurrent.futures
import json
import signal
import socket
import time
import urllib.request

import jax
import numpy as np
import pytest

import rlkjax
from rlkjax.client import RolloutError
from rlkjax.text.tokenizer import ByteTokenizer
from tests.helpers import assert_bits_equal
from tests.server_process import ADMIN, metric, post_raw, start_server, wait_for_metric

pytestmark = pytest.mark.slow  # every test here starts a real server process


@pytest.fixture(scope="module")
def server():
    proc, client = start_server("--read-timeout", "2")
    yield client
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


@pytest.mark.parametrize(
    "body,status,match",
    [
        (b"{not json", 400, "malformed JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"prompt": [1, 2], "colour": "red"}).encode(), 400, "unknown field"),
        (json.dumps({"max_new_tokens": 3}).encode(), 400, "missing field"),
        (json.dumps({"prompt": "abc"}).encode(), 400, "list of token ids"),
        (json.dumps({"prompt": []}).encode(), 400, "non-empty"),
        (json.dumps({"prompt": [1, 99999]}).encode(), 400, "outside"),
        (json.dumps({"prompt": [1, -2]}).encode(), 400, "outside"),
        (json.dumps({"prompt": [1, 2], "n": 0}).encode(), 400, "n must be"),
        (json.dumps({"prompt": [1, 2], "n": 10**9}).encode(), 400, "n must be"),
        (json.dumps({"prompt": [1, 2], "max_new_tokens": -1}).encode(), 400, "max_new_tokens"),
        (json.dumps({"prompt": [1, 2], "max_new_tokens": 10**9}).encode(), 400, "max_new_tokens"),
        (json.dumps({"prompt": [1] * 200, "max_new_tokens": 100}).encode(), 400, "context"),
        (json.dumps({"prompt": [1, 2], "temperature": 5e-5}).encode(), 400, "temperature"),  # 0 is greedy
        (json.dumps({"prompt": [1, 2], "temperature": -1}).encode(), 400, "temperature"),  # 0 is greedy
        (b'{"prompt": [1, 2], "temperature": NaN}', 400, "temperature"),
        (b'{"prompt": [1, 2], "temperature": Infinity}', 400, "temperature"),
        (json.dumps({"prompt": [1, 2], "temperature": "hot"}).encode(), 400, "temperature"),
        (json.dumps({"prompt": [1, 2], "seed": -1}).encode(), 400, "seed"),
        (json.dumps({"prompt": [[1, 2], [3, 600]]}).encode(), 400, "outside"),
        (json.dumps({"prompt": [[1, 2]] * 40, "n": 8}).encode(), 400, "over the limit of 256 per request"),
        (json.dumps({"prompt": [1] * (5 * 2**20)}).encode(), 413, "over the limit"),
    ],
)
def test_bad_input_gets_a_clear_4xx_and_the_server_keeps_serving(server, body, status, match):
    got, payload = post_raw(server, "/generate", body)
    assert got == status and match in payload["error"]["message"], payload
    assert server.generate([[1, 2, 3]], max_tokens=2, seed=0, ignore_eos=True)[0][0]["finish_reason"] == "length"


def test_update_weights_needs_the_admin_key(server, tmp_path):
    got, payload = post_raw(server, "/update_weights", json.dumps({"path": str(tmp_path)}).encode())
    assert got == 401 and "admin key" in payload["error"]["message"]
    got, payload = post_raw(
        server, "/update_weights", json.dumps({"path": str(tmp_path)}).encode(), {"Authorization": f"Bearer {ADMIN}"}
    )
    assert got == 400 and "cannot load" in payload["error"]["message"]


def test_openai_completions_and_metrics(server, tiny):
    """/v1/completions on the native server: each sample's logprobs (logprobs 0: no top logprobs, whose
    decode variant tests/test_openai_api.py covers; the rounds are those of /generate) are the learner's.
    /metrics exports the engine's counters; a 40-token prompt sent twice finds its 2 full pages in the
    prefix cache the second time, with the same tokens and bits."""
    cfg, params = tiny
    out = post_raw(
        server,
        "/v1/completions",
        json.dumps(
            {"model": "qwen3-tiny", "prompt": "Hello", "max_tokens": 5, "n": 2, "logprobs": 0, "seed": 3}
        ).encode(),
    )
    assert out[0] == 200
    choices = out[1]["choices"]
    assert len(choices) == 2 and all(c["finish_reason"] in ("length", "stop") for c in choices)
    prompt = list(b"Hello")
    for c in choices:
        lps = np.asarray(c["logprobs"]["token_logprobs"], np.float32)
        assert_bits_equal(
            rlkjax.score(params, cfg, [prompt + c["logprobs"]["token_ids"]], [len(prompt)])[0], lps, "completions"
        )
    text = server.metrics()
    for name in (
        "rlkjax_requests_total",
        "rlkjax_tokens_per_second",
        "rlkjax_queue_depth",
        "rlkjax_kv_pages_used",
        "rlkjax_compiled_shapes",
        "rlkjax_policy_version",
        "rlkjax_prefix_cache_lookups_total",
        "rlkjax_prefix_cache_hits_total",
        "rlkjax_prefix_cache_query_tokens_total",
        "rlkjax_prefix_cache_hit_rate",
        "rlkjax_prefix_cache_pages",
        "rlkjax_prefix_cache_evictions_total",
    ):
        assert name in text
    prompt = list(range(60, 100))
    first = server.generate([prompt], max_tokens=3, seed=1, ignore_eos=True)[0][0]
    before = metric(server, "rlkjax_prefix_cache_hit_tokens_total")
    again = server.generate([prompt], max_tokens=3, seed=1, ignore_eos=True)[0][0]
    assert metric(server, "rlkjax_prefix_cache_hit_tokens_total") == before + 32
    assert first["tokens"] == again["tokens"]
    assert_bits_equal(first["logprobs"], again["logprobs"], "second time, from the cache")


def test_200_concurrent_requests_and_a_weight_update_mid_load(tiny, tmp_path):
    """Every request answered exactly once, at its length or ended by eos, every completion exact under
    the weights of the version it reports; the update lands between steps. Then SIGTERM drains what is
    in flight (drain_on_sigterm; on this server rather than one of its own, whose first requests would
    compile the same programs again)."""
    cfg, params = tiny
    new_params = rlkjax.init_params(cfg, seed=1)
    rlkjax.save_hf_checkpoint(tmp_path / "v1", cfg, new_params)
    proc, client = start_server()
    rng = np.random.default_rng(0)
    jobs = [
        dict(
            prompt=rng.integers(0, cfg.vocab_size, int(rng.integers(1, 40))).tolist(),
            n=int(rng.integers(1, 3)),
            max_tokens=int(rng.integers(1, 8)),
            temperature=float(rng.choice([0.7, 1.0])),
            seed=i,
        )
        for i in range(200)
    ]
    try:
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            futures = [
                pool.submit(
                    client.generate,
                    [j["prompt"]],
                    n=j["n"],
                    max_tokens=j["max_tokens"],
                    temperature=j["temperature"],
                    seed=j["seed"],
                )
                for j in jobs
            ]
            wait_for_metric(client, "rlkjax_requests_finished_total", 1)  # version 0 has answered someone
            version = client.update_weights(str(tmp_path / "v1"))
            results = [f.result() for f in futures]
        assert version == 1
        by_version = {0: params, 1: new_params}
        seen_versions = set()
        for job, res in zip(jobs, results):
            assert len(res) == 1 and len(res[0]) == job["n"]
            for sample in res[0]:
                seen_versions.add(sample["policy_version"])
                # a sampled eos (the byte tokenizer's 256) ends a completion early and is its last token
                tokens, eos = sample["tokens"], ByteTokenizer.eos_token_id
                assert eos not in tokens[:-1]
                assert len(tokens) == job["max_tokens"] or (len(tokens) < job["max_tokens"] and tokens[-1] == eos)
                scored = rlkjax.score(
                    by_version[sample["policy_version"]],
                    cfg,
                    [job["prompt"] + sample["tokens"]],
                    [len(job["prompt"])],
                    temperature=job["temperature"],
                )[0]
                assert_bits_equal(sample["logprobs"], scored, f"seed {job['seed']}")
        assert seen_versions == {0, 1}, seen_versions
        assert client.generate([[1, 2]], max_tokens=1)[0][0]["policy_version"] == 1
        drain_on_sigterm(proc, client)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def drain_on_sigterm(proc, client):
    """SIGTERM once the server holds all 8 requests (polled from /metrics, so a slow machine cannot
    send the signal before a request has arrived): every one completes, then the process exits 0."""
    before = metric(client, "rlkjax_requests_total")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client.generate, [[i + 1, 2, 3]], max_tokens=200, seed=i) for i in range(8)]
        wait_for_metric(client, "rlkjax_requests_total", before + 8)
        finished_at_signal = metric(client, "rlkjax_requests_finished_total")
        proc.send_signal(signal.SIGTERM)
        results = [f.result() for f in futures]
    assert finished_at_signal < before + 8, "every request finished before SIGTERM: nothing was drained"
    assert all(len(r[0][0]["tokens"]) == 200 for r in results)
    assert proc.wait(timeout=120) == 0
    with pytest.raises((OSError, RolloutError)):
        client.health()


def test_unseeded_requests_differ_and_report_their_seed(server, tiny):
    """Without a seed each request draws fresh noise from the OS (a GRPO group sent as separate
    requests used to get identical samples, zero advantage, no error); the response names the
    seed, and sending it back reproduces the sample bit for bit."""
    bodies = [
        post_raw(server, "/generate", json.dumps({"prompt": [5, 6, 7], "max_new_tokens": 8}).encode())[1]
        for _ in range(4)
    ]
    assert len({tuple(b["results"][0][0]["tokens"]) for b in bodies}) > 1 and len({b["seed"] for b in bodies}) == 4
    again = post_raw(
        server, "/generate", json.dumps({"prompt": [5, 6, 7], "max_new_tokens": 8, "seed": bodies[0]["seed"]}).encode()
    )[1]
    assert again["results"][0][0]["tokens"] == bodies[0]["results"][0][0]["tokens"]
    assert_bits_equal(
        np.float32(again["results"][0][0]["logprobs"]), np.float32(bodies[0]["results"][0][0]["logprobs"]), "reseeded"
    )
    got, out = post_raw(server, "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2, "seed": None}).encode())
    assert got == 200 and isinstance(out["seed"], int)


def test_errors_have_openai_shape(server):
    got, payload = post_raw(server, "/generate", json.dumps({"prompt": [1, 2], "n": 0}).encode())
    assert got == 400 and set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["type"] == "invalid_request_error" and "n must be" in payload["error"]["message"]


def test_a_disconnected_client_frees_its_pages(server):
    """A client that gives up mid-generation: its sequences are cancelled and their KV pages freed
    (aiohttp cancels the handler only with handler_cancellation; before, the server went on
    generating for minutes). Pages are read from /metrics before, during and after."""
    assert metric(server, "rlkjax_kv_pages_used") == 0
    body = json.dumps({"prompt": list(range(1, 60)), "n": 4, "max_new_tokens": 190, "seed": 1}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for_metric(server, "rlkjax_kv_pages_used", 1)
        during = metric(server, "rlkjax_kv_pages_used")
    deadline = time.time() + 60
    while metric(server, "rlkjax_kv_pages_used") > 0:
        assert time.time() < deadline, "pages still held a minute after the client left"
        time.sleep(0.1)
    generated = metric(server, "rlkjax_generated_tokens_total")
    time.sleep(1.0)
    assert during > 0 and metric(server, "rlkjax_generated_tokens_total") == generated, "still generating for nobody"
    assert metric(server, "rlkjax_running_sequences") == 0


def test_update_weights_refuses_what_would_change_the_served_model_silently(server, tiny, tmp_path):
    """Each refused with a 4xx naming the reason, the old weights kept (policy version unchanged):
    a preset name (used to build a random model), float32 weights (used to be served in float32,
    breaking sampler == learner), a NaN, an index entry outside the checkpoint directory and a
    float32 tensor under a bfloat16 config.json (both used to be loaded and served), an extra
    tensor, corrupt safetensors and config.json (used to be a bare 500)."""
    from safetensors.numpy import load_file, save_file

    cfg, params = tiny
    version = server.health()["policy_version"]

    def checkpoint(name, edit=None, dtype=None):
        path = tmp_path / name
        rlkjax.save_hf_checkpoint(
            path,
            cfg.replace_dtype(dtype) if dtype else cfg,
            jax.tree.map(lambda w: w.astype(dtype), params) if dtype else params,
        )
        if edit:
            edit(path)
        return str(path)

    def add_nan(path):
        t = load_file(path / "model.safetensors")
        t["model.norm.weight"] = t["model.norm.weight"].copy()
        t["model.norm.weight"][3] = np.nan
        save_file(t, path / "model.safetensors")

    def escape(path):  # an index whose entry names a file outside the checkpoint directory
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.norm.weight": "../f32/model.safetensors"}})
        )

    def norm_f32(path):  # config.json says bfloat16; one tensor is stored in float32
        from safetensors.flax import load_file as load_jax
        from safetensors.flax import save_file as save_jax

        t = load_jax(path / "model.safetensors")
        save_jax(t | {"model.norm.weight": t["model.norm.weight"].astype("float32")}, path / "model.safetensors")

    def add_tensor(path):
        save_file(
            load_file(path / "model.safetensors") | {"model.layers.0.mlp.gate_proj.bias": np.zeros(4, np.float32)},
            path / "model.safetensors",
        )

    cases = {
        "qwen3-tiny": "not a checkpoint directory",
        checkpoint("f32", dtype="float32"): "dtype float32 is not the served dtype bfloat16",
        checkpoint("nan", add_nan): "non-finite values in ['norm']",
        checkpoint("escape", escape): "entry '../f32/model.safetensors' resolves to",
        checkpoint("norm_f32", norm_f32): "model.norm.weight is stored as float32",
        checkpoint("extra", add_tensor): "gate_proj.bias",
        checkpoint("bad_safetensors", lambda p: (p / "model.safetensors").write_bytes(b"\x00" * 100)): "cannot load",
        checkpoint("bad_config", lambda p: (p / "config.json").write_text('{"vocab_size": ')): "cannot load",
    }
    for path, match in cases.items():
        got, payload = post_raw(
            server, "/update_weights", json.dumps({"path": path}).encode(), {"Authorization": f"Bearer {ADMIN}"}
        )
        assert got == 400 and match in payload["error"]["message"], (path, payload)
    assert server.health()["policy_version"] == version
    assert server.generate([[1, 2, 3]], max_tokens=2)[0][0]["policy_version"] == version


def test_admin_key_from_a_file_case_insensitive_scheme_and_no_lock_out(tmp_path):
    """The key read from --admin-key-file (a flag would show in `ps`) wins over the environment;
    `bearer` is accepted in any case (RFC 7235). Wrong keys get 401, past 5 a minute from one address
    429, and the log names the address and the count (every failure up to 5, then at powers of two).
    The right key still gets in at once from the same address: after 5 wrong keys from 127.0.0.1 the
    right one used to get 429 too, so any local process could lock the trainer out of weight pushes."""
    (tmp_path / "key").write_text("file-key\n")
    proc, client = start_server("--admin-key-file", str(tmp_path / "key"))
    try:
        body = json.dumps({"path": str(tmp_path)}).encode()
        got, payload = post_raw(client, "/update_weights", body, {"Authorization": "bEaReR file-key"})
        assert got == 400 and "cannot load" in payload["error"]["message"]  # authenticated; the path is empty
        statuses = [post_raw(client, "/update_weights", body, {"Authorization": f"Bearer {ADMIN}"}) for _ in range(20)]
        assert [got for got, _ in statuses] == [401] * 5 + [429] * 15
        last = statuses[-1][1]["error"]
        assert last["type"] == "rate_limit_error" and "20 from 127.0.0.1" in last["message"], last
        start = time.monotonic()
        got, payload = post_raw(client, "/update_weights", body, {"Authorization": "Bearer file-key"})
        assert got == 400 and "cannot load" in payload["error"]["message"], payload
        assert time.monotonic() - start < 5
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    log = open(proc.log).read()
    assert log.count("rejected admin key from 127.0.0.1 (port ") == 7
    for count in (1, 5, 8, 16):
        assert f": {count} wrong keys from this address in 60 s" in log


def test_null_means_default_and_models(server):
    """OpenAI clients send explicit nulls for unset optional fields: they mean the default."""
    body = {
        "prompt": "Hi",
        "max_tokens": None,
        "temperature": None,
        "n": None,
        "seed": None,
        "logprobs": None,
        "user": None,
    }
    got, out = post_raw(server, "/v1/completions", json.dumps(body).encode())
    assert got == 200 and len(out["choices"]) == 1 and out["usage"]["completion_tokens"] <= 16
    got, out = post_raw(
        server,
        "/generate",
        json.dumps({"prompt": [1, 2], "n": None, "max_new_tokens": None, "stop_token_ids": None}).encode(),
    )
    # the default max_new_tokens (16), unless the sampler (seed unset: a random one) drew eos before it
    result = out["results"][0][0]
    assert got == 200 and (len(result["tokens"]) == 16 or result["finish_reason"] == "stop"), result
    with urllib.request.urlopen(server.url + "/v1/models", timeout=60) as r:
        models = json.loads(r.read())
    assert models["object"] == "list" and models["data"][0]["id"] == "qwen3-tiny"


@pytest.mark.parametrize("how", ["deadline", "second-signal"])
def test_shutdown_with_a_deadline(how):
    """SIGTERM drains only up to --shutdown-timeout (here 1 s), or until a second SIGTERM: what is
    unfinished then is cancelled and answered 503 (a JSON error, not a dropped connection), new
    requests get 503 meanwhile, and the process exits 0 (a second signal used to drop every answer
    and exit 1). The work cannot drain in 1 s on any machine: 8 requests of 4 samples x 240 tokens
    are four waves of the 8-row batch, 240 decode rounds at least (4 single samples, 30 rounds at
    batch 4, can drain within 1.3 s on a fast idle machine, leaving nothing cut off to check)."""
    timeout = "1" if how == "deadline" else "300"
    proc, client = start_server("--shutdown-timeout", timeout)
    body = json.dumps({"prompt": [1, 2, 3], "n": 4, "max_new_tokens": 240, "seed": 0}).encode()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(post_raw, client, "/generate", body) for _ in range(8)]
        wait_for_metric(client, "rlkjax_generated_tokens_total", 1)
        signalled = time.time()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = post_raw(client, "/generate", body)
        if how == "second-signal":
            proc.send_signal(signal.SIGTERM)
            signalled = time.time()  # from now on the process must not wait for the engine
        answers = [f.result() for f in futures]
    assert late[0] == 503 and "shutting down" in late[1]["error"]["message"]
    assert proc.wait(timeout=120) == 0
    limit = 60 if how == "deadline" else 10
    assert time.time() - signalled < limit, "the deadline was not kept"
    for code, payload in answers:  # finished in time, or cancelled with a clear 503
        assert (code == 200 and len(payload["results"][0][0]["tokens"]) == 240) or (
            code == 503 and "--shutdown-timeout" in payload["error"]["message"]
        ), (code, payload)
    assert any(code == 503 for code, _ in answers), "nothing was cut off: the test did not exercise the deadline"


@pytest.mark.parametrize(
    "data,headers,match",
    [
        (b'{"prompt": [1, 2], "x": "\xff\xfe"}', {}, "not valid utf-8"),
        (b'{"prompt": [1, 2]}', {"Content-Type": "application/json; charset=klingon"}, "unknown charset"),
        (b'{"prompt": "\\ud800abc", "max_tokens": 2}', {}, "not valid Unicode"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, "nested too deeply"),
        (b'{"prompt": [1, 2], "n": ' + b"9" * 5000 + b"}", {}, "malformed JSON"),
        (b'{"prompt": [1, 2], "n": 1e999}', {}, "n must be"),
        (b"\x1f\x8b\x08\x00garbage-not-gzip", {"Content-Encoding": "gzip"}, "cannot read the body"),
    ],
    ids=[
        "invalid-utf8",
        "unknown-charset",
        "lone-surrogate",
        "deep-nesting",
        "huge-integer",
        "huge-float",
        "corrupt-gzip",
    ],
)
def test_every_bad_body_is_a_4xx(server, data, headers, match):
    """One case per category of hostile bytes; each used to end in a 500. The server then still serves."""
    path = "/v1/completions" if b'"\\ud800' in data else "/generate"
    got, payload = post_raw(server, path, data, headers)
    assert 400 <= got < 500 and match in payload["error"]["message"], (got, payload)
    assert server.generate([[1, 2, 3]], max_tokens=2, seed=0, ignore_eos=True)[0][0]["finish_reason"] == "length"


def test_a_slow_client_gets_a_read_timeout(server):
    """A client that sends half its body and stalls gets 408 after --read-timeout (2 s here) instead
    of holding a handler open forever."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt"'
        )
        start = time.time()
        reply = sock.recv(65536).decode(errors="replace")
    assert reply.startswith("HTTP/1.1 408") and "did not arrive within 2 s" in reply, reply[:300]
    assert time.time() - start < 20


def test_slow_and_numerous_clients_header_timeout_and_connection_cap():
    """--header-timeout 2: a client trickling its headers a byte at a time is closed after about 2 s
    (500 such clients used to hold their connections 60 s and more). --max-connections 4: with four
    connections open (their heads unsent), a fifth reads a 503 naming the flag; once they are closed
    by the same timeout, requests are served again."""
    proc, client = start_server("--header-timeout", "2", "--max-connections", "4")
    port = int(client.url.rsplit(":", 1)[1])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            start, closed = time.monotonic(), False
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:
                try:
                    sock.sendall(bytes([byte]))
                    closed = sock.recv(1) == b""
                except TimeoutError:
                    continue
                except OSError:
                    closed = True
                if closed:
                    break
            assert closed and 1.5 < time.monotonic() - start < 10, time.monotonic() - start
        idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(4)]
        try:
            got, payload = post_raw(client, "/generate", json.dumps({"prompt": [1, 2]}).encode())
            assert got == 503 and "--max-connections" in payload["error"]["message"], payload
            assert all(sock.recv(1) == b"" for sock in idle)  # closed by the server at the header timeout
        finally:
            for sock in idle:
                sock.close()
        assert client.health()["status"] == "ok"
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def test_health_and_metrics_answer_while_the_engine_compiles(tmp_path):
    """/health and /metrics are polled while a fresh server compiles and runs its first request: no
    answer waits out a compilation (they used to take the engine's lock on the event loop and wait out
    a whole step: the longest compilation, seconds). The server gets an empty compilation cache, so it
    compiles whatever ran before. The limit comes from what it guards, not from a fixed number of
    seconds that a loaded machine breaks (a 0.5 s limit failed at load 10): the request takes
    `duration`, most of it compiling its N step programs (the executables it stored), so the longest
    compilation, which a blocked answer would wait out, is more than about duration / (2 N); an answer
    must come within half that. Load slows the compilations and the answers alike."""
    cache = tmp_path / "jax"
    proc, client = start_server("--compilation-cache", str(cache))
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            start = time.perf_counter()
            first = pool.submit(client.generate, [list(range(1, 50))], n=3, max_tokens=40, seed=0)
            slowest = 0.0
            while not first.done():
                for call in (client.health, client.metrics):
                    asked = time.perf_counter()
                    call()
                    slowest = max(slowest, time.perf_counter() - asked)
                time.sleep(0.02)
            duration = time.perf_counter() - start
            assert len(first.result()[0]) == 3
        programs = len(list((cache / "executables").glob("*.bin")))
        assert programs >= 2, programs  # a prefill and a decode round at least
        limit = duration / (4 * programs)
        assert slowest < limit, f"slowest answer {slowest:.2f} s; {programs} programs compiled in {duration:.1f} s"
    finally:
        proc.terminate()
        proc.wait(timeout=120)


@pytest.mark.slow
def test_warm_up_before_serving(tiny):
    """With --warmup the server compiles every default batch shape before /health answers, and
    serving a mix of requests (n 1 and 2, batches 1 and 2) compiles nothing more; the logprobs
    stay the learner's. The engine is the other servers' (tests.helpers.ENGINE): the warm-up loads
    the executables they stored and compiles only the shapes no earlier request ran."""
    proc, client = start_server("--warmup")
    try:
        # prefill of 1, 2 sequences (the 32-token budget in 16-token chunks); decode rounds of 4 steps and
        # of 1, each of 8 rows (the strict forward carries 16 rows anyway); page copies of 1, 2, 4, 8
        shapes = 2 + 1 + 1 + 4
        assert metric(client, "rlkjax_compiled_shapes") == shapes
        assert f"warm-up: {shapes} shapes compiled" in open(proc.log).read()
        cfg, params = tiny
        for n, prompt in ((1, [5, 6, 7]), (2, list(range(1, 40)))):
            out = client.generate([prompt], n=n, max_tokens=5, seed=1)[0]
            for sample in out:
                scored = rlkjax.score(params, cfg, [prompt + sample["tokens"]], [len(prompt)])[0]
                assert_bits_equal(np.asarray(sample["logprobs"], np.float32), scored, f"n={n}")
        assert metric(client, "rlkjax_compiled_shapes") == shapes
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def test_no_response_carries_nan_or_infinity():
    """json.dumps writes NaN/Infinity by default, which is not JSON: every response goes through a
    writer that refuses them (the middleware turns that into a logged 500, never a 200)."""
    from serve.http import json_response

    assert json.loads(json_response({"logprobs": [-0.5]}).body) == {"logprobs": [-0.5]}
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError):
            json_response({"logprobs": [bad]})
