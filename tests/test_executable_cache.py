"""The executable cache: a restarted engine loads its step functions' executables from disk instead of
tracing, lowering and compiling them, and serves the same bits (the learner's); donation survives the
round trip; the key separates what decides a program; a bad entry is recompiled with a warning, never a
crash; writes are atomic; 'off' writes nothing."""

import hashlib
import logging
import os
import pickle
import subprocess
import sys
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlkjax
from rlkjax.engine import engine as engine_module
from rlkjax.engine import executable_cache
from rlkjax.engine.compilation_cache import CompileTimes
from rlkjax.engine.config import EngineConfig
from rlkjax.engine.engine import Engine
from tests.helpers import assert_bits_equal

STEP_FUNCTIONS = (engine_module.prefill_chunk, engine_module.next_round, engine_module.copy_pages)
# 4 warm-up shapes (batch 1: a prefill chunk, rounds of 2 steps and of 1, a page copy); a 29-token prompt
# takes two prefill chunks.
CONFIG = EngineConfig(num_pages=24, max_batch=1, prefill_chunk=16, token_budget=16, max_context=64, decode_steps=2)


def forget_loaded(functions) -> None:
    """What a new process knows: nothing in memory (the executables stay on disk). Also unmaps the
    compiled code (conftest's _unmap_compiled_code explains why that matters)."""
    for fn in functions:
        fn.loaded.clear()


@pytest.fixture
def cache_dir(tmp_path):
    """The executable cache on, in a fresh directory, for this test only."""
    directory = tmp_path / "executables"
    executable_cache.use_directory(directory)
    try:
        yield directory
    finally:
        executable_cache.use_directory(None)
        forget_loaded(STEP_FUNCTIONS)


def serve(params, cfg, prompts):
    """Warm an engine up and sample `prompts` (one sample each); returns the completions, the compile
    times of both, and the engine."""
    engine = Engine(params, cfg, config=CONFIG)
    with CompileTimes() as times:
        engine.warm_up()
        requests = [engine.submit(p, max_tokens=5, temperature=1.0, seed=i) for i, p in enumerate(prompts)]
        engine.run_until_done()
    return [r.results[0] for r in requests], times, engine


def test_loaded_executables_serve_the_bits_the_compiled_ones_and_the_learner_give(tiny, cache_dir):
    """A warm start must not change a single bit: the executables loaded from disk give the tokens and
    logprob bits of the run that compiled them, which equal `rlkjax.score`'s; loading traces, lowers
    and compiles nothing; the loaded round still donates the KV cache (its input/output aliasing is
    part of the executable), so the cache is not copied every round."""
    check_loaded_executables(*tiny, cache_dir)


@pytest.mark.gpu
def test_loaded_executables_on_the_gpu(tiny, cache_dir):
    """The same on a GPU, where the executables hold the compiled Triton kernels."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    check_loaded_executables(*tiny, cache_dir)


def check_loaded_executables(cfg, params, cache_dir):
    prompts = [[3, 1, 4, 1, 5], list(range(1, 30))]
    cold, cold_times, _ = serve(params, cfg, prompts)
    files = sorted(cache_dir.glob("*.bin"))
    assert len(files) == 4 and cold_times.executables_loaded == 0, (files, cold_times)

    forget_loaded(STEP_FUNCTIONS)
    # what a warm start does first: read every stored warm-up executable, from several threads at once
    assert Engine(params, cfg, config=CONFIG).load_warm_up(threads=4) == 4
    assert all(fn.loaded for fn in STEP_FUNCTIONS)
    forget_loaded(STEP_FUNCTIONS)
    warm, warm_times, engine = serve(params, cfg, prompts)
    assert warm_times.executables_loaded == 4, warm_times
    assert warm_times.seconds["trace"] == warm_times.seconds["lower"] == warm_times.seconds["compile"] == 0, warm_times
    assert sorted(cache_dir.glob("*.bin")) == files
    for prompt, a, b in zip(prompts, cold, warm, strict=True):
        assert a.tokens == b.tokens
        assert_bits_equal(a.logprobs, b.logprobs, "loaded executable")
        scored = rlkjax.score(params, cfg, [prompt + b.tokens], [len(prompt)], temperature=1.0)[0]
        assert_bits_equal(b.logprobs, scored, "learner")

    cache = engine.cache
    engine.submit([7, 7, 7], max_tokens=2, seed=0)
    engine.run_until_done()
    assert all(x.is_deleted() for x in cache), "a loaded round copied the KV cache instead of donating it"


def accumulate(acc, x, scale):
    return acc + x * scale, jnp.sum(x)


@pytest.fixture
def cheap(cache_dir, request):
    """`accumulate` through the cache in `cache_dir`, and a call of it: (function, call). Each test gets a
    program of its own (named after the test): JAX's persistent cache, which the run shares, holds none of
    them, so the first call compiles for real and stores the executable (what JAX's cache returns is not
    stored: test_what_jax_s_cache_returned_is_served_not_stored)."""

    def program(acc, x, scale):
        return accumulate(acc, x, scale)

    program.__name__ = program.__qualname__ = f"accumulate_{zlib.crc32(request.node.nodeid.encode())}"
    fn = executable_cache.cached(jax.jit(program, static_argnames=("scale",), donate_argnames=("acc",)), "scale")

    def call(n=4, scale=2.0):
        out, total = fn(jnp.zeros(n), np.arange(n, dtype=np.float32), scale)
        return np.asarray(out).tolist(), float(total)

    yield fn, call
    forget_loaded([fn])


def test_the_key_separates_static_arguments_shapes_and_source(cheap, cache_dir, monkeypatch):
    """Each thing that decides the program gets its own entry; the same call again is one entry."""
    fn, call = cheap
    assert call() == ([0.0, 2.0, 4.0, 6.0], 6.0)
    call()
    assert len(list(cache_dir.glob("*.bin"))) == 1
    assert call(scale=3.0) == ([0.0, 3.0, 6.0, 9.0], 6.0)
    assert call(n=5)[1] == 10.0
    assert len(list(cache_dir.glob("*.bin"))) == 3
    monkeypatch.setattr(executable_cache, "_fingerprint", executable_cache.environment().replace("source", "source 0"))
    forget_loaded([fn])
    assert fn.prepare(jnp.zeros(4), np.zeros(4, np.float32), 2.0) == "compiled"  # other source, other program
    assert len(list(cache_dir.glob("*.bin"))) == 4


def test_the_environment_names_versions_backend_flags_and_source():
    env = executable_cache.environment()
    for part in (jax.__version__, jax.default_backend(), "XLA_FLAGS", executable_cache.source_hash()):
        assert part in env, part


def entry_for_another_key(data: bytes) -> bytes:
    """A well-formed entry (right magic and checksum) whose stored key is not the one its name hashes."""
    payload = pickle.loads(data[len(executable_cache.MAGIC) + 32 :])
    payload = pickle.dumps((payload[0] + " ", *payload[1:]))
    return executable_cache.MAGIC + hashlib.sha256(payload).digest() + payload


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "garbage", "other key", "empty"])
def test_a_bad_entry_is_recompiled_with_a_warning(cheap, cache_dir, caplog, damage):
    """A disk that filled up, a crash, a stray file: the call still gives the right answer, a warning
    names the file, and the entry is not read again: written anew, or removed where JAX's cache returned
    the program (such an executable is not stored)."""
    fn, call = cheap
    expected = call()
    (path,) = cache_dir.glob("*.bin")
    data = path.read_bytes()
    damaged = {
        "truncated": data[: len(data) // 2],
        "flipped byte": data[:-10] + bytes([data[-10] ^ 1]) + data[-9:],
        "garbage": os.urandom(len(data)),
        "other key": entry_for_another_key(data),
        "empty": b"",
    }[damage]
    path.write_bytes(damaged)
    forget_loaded([fn])
    with caplog.at_level(logging.WARNING, logger="rlkjax.engine.executable_cache"):
        assert call() == expected
    assert f"ignoring {path}" in caplog.text, caplog.text
    assert not path.exists() or path.read_bytes() != damaged
    forget_loaded([fn])
    with caplog.at_level(logging.WARNING, logger="rlkjax.engine.executable_cache"):
        caplog.clear()
        assert call() == expected
    assert "ignoring" not in caplog.text, caplog.text


def test_an_unwritable_directory_warns_and_serves(cheap, tmp_path, caplog):
    """A cache that cannot be written (here a file where the directory should be) costs the speed-up,
    never the answer."""
    fn, call = cheap
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    executable_cache.use_directory(blocked / "executables")
    with caplog.at_level(logging.WARNING, logger="rlkjax.engine.executable_cache"):
        assert call() == ([0.0, 2.0, 4.0, 6.0], 6.0)
    assert "cannot store" in caplog.text, caplog.text
    assert blocked.read_text() == ""


def test_what_jax_s_cache_returned_is_served_not_stored(cheap, cache_dir):
    """An executable that JAX's persistent compilation cache returned is served but not stored: XLA:CPU
    serialises it without some of its kernels, and every process that loaded the entry failed at its first
    call ("Function wrapped_iota not found"; a server compiling what a trainer had put in the shared cache
    broke the next server's start)."""
    fn, call = cheap
    expected = call()  # compiled for real: stored, and in JAX's cache
    assert len(list(cache_dir.glob("*.bin"))) == 1
    forget_loaded([fn])
    jax.clear_caches()  # what a new process knows: the program is in JAX's cache on disk only
    for entry in cache_dir.glob("*.bin"):
        entry.unlink()
    assert call() == expected  # from JAX's cache
    assert list(cache_dir.glob("*.bin")) == []


def test_no_directory_means_jit_alone(cheap):
    fn, call = cheap
    executable_cache.use_directory(None)
    assert fn.prepare(jnp.zeros(4), np.zeros(4, np.float32), 2.0) is None
    assert call() == ([0.0, 2.0, 4.0, 6.0], 6.0)
    assert not fn.loaded


STORE = """
import sys, jax, jax.numpy as jnp
from rlkjax.engine import compilation_cache, executable_cache
compilation_cache.enable(sys.argv[1])
def triple_sin(x):
    return jnp.sin(x) * 3
fn = executable_cache.cached(jax.jit(triple_sin))
print(fn.prepare(jnp.zeros(8)), float(fn(jnp.ones(8))[0]))
"""


def test_servers_sharing_a_directory_store_and_load_safely_and_off_writes_nothing(tmp_path):
    """Three processes store the same entry at once (each writes a temporary file and renames it: no
    reader ever sees half an entry), a fourth loads it; 'off' writes no executable."""
    env = os.environ | {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(Path(__file__).parents[1])}
    run = [sys.executable, "-c", STORE, str(tmp_path / "on")]
    procs = [subprocess.Popen(run, env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs) and len({o[1] for o in outs}) == 1, outs
    assert [p.name for p in (tmp_path / "on" / "executables").iterdir()] == [
        p.name for p in (tmp_path / "on" / "executables").glob("*.bin")
    ], "a temporary file was left behind"
    again = subprocess.run(run, env=env, cwd=tmp_path, check=True, capture_output=True, text=True, timeout=300)
    assert again.stdout.split() == ["disk", outs[0][1]], again.stdout
    before = sorted(tmp_path.rglob("*"))
    off = [sys.executable, "-c", STORE, "off"]
    subprocess.run(off, env=env, cwd=tmp_path, check=True, capture_output=True, timeout=300)
    assert sorted(tmp_path.rglob("*")) == before


# STORE, in a process whose read of the entry finds nothing, then another process stores it (the entry
# the test set aside as <entry>.other comes back), and whose compilation JAX's cache answers (that other
# process filled it).
STORE_LATE = STORE.replace(
    "fn = executable_cache",
    "import os\nexecutable_cache._read = lambda path, text: os.replace(f'{path}.other', path)\nfn = executable_cache",
)


def test_a_program_from_jax_cache_leaves_another_process_entry_alone(tmp_path):
    """A process that found no entry, compiled, and got its program from JAX's cache stores nothing (that
    executable would be broken) and leaves the entry another process stored meanwhile: the next process
    loads it. (It deleted it once: servers sharing a directory compiled again at every start.)"""
    env = os.environ | {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(Path(__file__).parents[1])}

    def store(script):
        run = [sys.executable, "-c", script, str(tmp_path)]
        return subprocess.run(run, env=env, check=True, capture_output=True, text=True, timeout=300).stdout.split()

    first = store(STORE)
    assert first[0] == "compiled"
    (entry,) = (tmp_path / "executables").glob("*.bin")
    entry.rename(f"{entry}.other")
    assert store(STORE_LATE) == first  # compiled (by JAX's cache): not stored
    assert sorted((tmp_path / "executables").iterdir()) == [entry]
    assert store(STORE) == ["disk", first[1]]
