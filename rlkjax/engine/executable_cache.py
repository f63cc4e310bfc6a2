"""The engine's compiled programs kept on disk, so a restarted server loads them instead of tracing,
lowering and compiling them again.

JAX's persistent compilation cache (rlkjax.engine.compilation_cache) removes only the compile: its key is the
lowered program, so every start still traces and lowers each program, and on CPU the Pallas
interpret-mode programs make that most of a warm start
(bench/results/2026-12-03_h200_cpu_measurements_behind_defaults.md). This cache keeps the executables
themselves (jax.experimental.serialize_executable), under a key that covers everything that decides the
program without lowering it:

- the environment: jax and jaxlib versions, the backend's platform and version, its devices, XLA_FLAGS,
  every JAX config value that can change a program, and a hash of the source of rlkjax and pallas_kernels;
- the function (its module and name) and its static arguments (ModelConfig, numerics, num_steps, ...);
- the pytree structure, shapes, dtypes, weak types and shardings of its array arguments.

A hit runs the very executable a cold start compiled, donation (its input/output aliasing) included, so
the bits of every result are the same; tests/test_startup.py checks it. A miss lowers and compiles as
`jax.jit` would (through JAX's own cache) and stores the result. An unreadable, truncated or corrupt entry
is logged and recompiled, never fatal; entries are written to a temporary file and renamed into place, so
servers sharing the directory never read a half-written one. Loading runs a pickle: the directory must be
as trusted as the code (it is the user's own cache). It lives in `executables/` under the compilation-cache
directory, is used only once `compilation_cache.enable(dir)` ran (the server, train.grpo), and 'off'
disables it with JAX's cache.
"""

import contextlib
import hashlib
import importlib
import inspect
import logging
import os
import pickle
import sys
import threading
import time
from pathlib import Path

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable

log = logging.getLogger("rlkjax.engine.executable_cache")

MAGIC = b"rlkjax executable 1\n"
# jax.monitoring event of each executable loaded from disk (compilation_cache.CompileTimes counts them)
LOAD_EVENT = "/rlkjax/executable_cache/load_duration"
# The packages whose source decides a program's lowered text.
SOURCE_PACKAGES = ("rlkjax", "pallas_kernels")

_directory: Path | None = None  # set by compilation_cache.enable(); None: every call goes to jax.jit
_fingerprint: str | None = None  # of the environment, computed at the first miss


def use_directory(path: str | os.PathLike | None) -> None:
    """Keep executables in `path` (None: off; the programs run through jax.jit alone)."""
    global _directory
    _directory = None if path is None else Path(path)


def directory() -> Path | None:
    return _directory


def source_hash() -> str:
    """sha256 over the Python source of SOURCE_PACKAGES (file names and contents, in sorted order)."""
    digest = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        root = Path(next(iter(importlib.import_module(package).__path__)))  # a namespace package has no __file__
        for path in sorted(root.rglob("*.py")):
            digest.update(f"{package}/{path.relative_to(root)}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def environment() -> str:
    """Everything outside a call's own arguments that decides the program and what it runs on."""
    backend = jax.devices()[0].client
    # Where the cache lives and how JAX caches decide nothing about a program.
    settings = {
        k: v for k, v in jax.config.values.items() if "compilation_cache" not in k and "persistent_cache" not in k
    }
    lines = [
        f"jax {jax.__version__} jaxlib {jaxlib.__version__} numpy {np.__version__} python {sys.version_info[:3]}",
        f"backend {backend.platform} {backend.platform_version}",
        f"devices {[(d.id, d.device_kind) for d in jax.devices()]} processes {jax.process_count()}",
        f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')!r} LIBTPU_INIT_ARGS {os.environ.get('LIBTPU_INIT_ARGS', '')!r}",
        f"config {sorted(settings.items())!r}",
        f"source {source_hash()}",
    ]
    return "\n".join(lines)


def _abstract(x):
    """What the program depends on of one argument leaf (not its values). A NumPy array and an uncommitted
    jax.Array both go to the default device: one executable serves both, as one jit compilation does."""
    if isinstance(x, jax.Array):
        return (x.shape, x.dtype, x.weak_type, _Placement(x.sharding) if x.committed else None)
    if isinstance(x, np.ndarray | np.generic):
        return (np.shape(x), x.dtype, False, None)
    return (type(x),)  # a Python scalar: a weakly typed argument


class _Placement:
    """A sharding in a key: compared as the sharding, written with the ids of its devices in order (a
    mesh's repr names its axes, not which device sits where)."""

    def __init__(self, sharding):
        self.sharding = sharding

    def __eq__(self, other):
        return isinstance(other, _Placement) and self.sharding == other.sharding

    def __hash__(self):
        return hash(self.sharding)

    def __repr__(self):
        mesh = getattr(self.sharding, "mesh", None)
        devices = (
            [d.id for d in mesh.devices.flat] if mesh is not None else sorted(d.id for d in self.sharding.device_set)
        )
        return f"{self.sharding!r} on devices {devices}"


class CachedFunction:
    """A jitted function called through executables kept on disk (where a directory is set); called
    positionally, with the same arguments as the function, static ones included."""

    def __init__(self, fn, static: tuple[str, ...]):
        """fn: a jax.jit function; static: its static_argnames (checked by the first compiled call:
        an executable compiled with other static arguments refuses the call's pytree)."""
        self.fn, self.static = fn, static
        self.signature = inspect.signature(fn)
        names = list(self.signature.parameters)
        self.static_at = tuple(names.index(name) for name in static)
        self.dynamic_at = tuple(i for i in range(len(names)) if i not in self.static_at)
        self.name = f"{fn.__module__}.{fn.__qualname__}"
        self.loaded: dict = {}  # (directory, static values, signature) -> jax.stages.Compiled
        self.lock = threading.Lock()

    def __call__(self, *args):
        if _directory is None:
            return self.fn(*args)
        dynamic, key = self._split(args)
        compiled = self.loaded.get(key) or self._load_or_compile(key, args)[0]
        return compiled(*dynamic)

    def prepare(self, *args) -> str | None:
        """Load or compile the executable of these arguments without running it (a warm-up); returns
        where it came from: "memory", "disk" or "compiled". None where no directory is set: nothing
        prepared (jax.jit compiles at the first call; a warm-up runs the function instead)."""
        if _directory is None:
            return None
        _, key = self._split(args)
        if key in self.loaded:
            return "memory"
        return self._load_or_compile(key, args)[1]

    def _split(self, args):
        """(dynamic arguments, key). On the decode loop's path: every argument given (the engine's
        calls) skips binding the signature, a third of the time."""
        if len(args) != len(self.signature.parameters):
            bound = self.signature.bind(*args)
            bound.apply_defaults()
            args = tuple(bound.arguments.values())
        static = tuple(args[i] for i in self.static_at)
        dynamic = tuple(args[i] for i in self.dynamic_at)
        leaves, tree = jax.tree_util.tree_flatten(dynamic)
        return dynamic, (_directory, static, tree, tuple(_abstract(x) for x in leaves))

    def load(self, *args) -> bool:
        """Read this call's executable from disk into memory if it is stored there; never compiles.
        Loads of different calls run at once from several threads (deserialising runs outside
        Python's lock), which a warm start uses (`Engine.load_warm_up`). Returns whether it is in
        memory now."""
        if _directory is None:
            return False
        _, key = self._split(args)
        if key in self.loaded:
            return True
        compiled = _read(*self._entry(key))
        if compiled is None:
            return False
        with self.lock:
            self.loaded.setdefault(key, compiled)
        return True

    def _entry(self, key) -> tuple[Path, str]:
        """Where the executable of `key` is stored, and the key's full text (kept in the file)."""
        global _fingerprint
        directory, static, tree, leaves = key
        if _fingerprint is None:
            _fingerprint = environment()  # the same text from any thread: computing it twice is harmless
        text = f"{_fingerprint}\nfunction {self.name}\nstatic {static!r}\ntree {tree}\nleaves {leaves!r}"
        return directory / f"{self.fn.__name__}-{hashlib.sha256(text.encode()).hexdigest()[:40]}.bin", text

    def _load_or_compile(self, key, args):
        with self.lock:
            if key in self.loaded:
                return self.loaded[key], "memory"
            path, text = self._entry(key)
            unusable = path.exists()  # if the read below finds nothing usable
            compiled, how = _read(path, text), "disk"
            if compiled is None:
                hits = _jax_cache_hits()
                compiled, how = self.fn.lower(*args).compile(), "compiled"
                if _jax_cache_hits() == hits:
                    _write(path, text, compiled)
                else:  # see _note_jax_cache_hit: storing it would store a broken executable
                    log.info("executable cache: %s came from JAX's cache; not stored", path.name)
                    # An unusable entry found above is not read again. Where there was none, the entry that
                    # may be there now is another process's, stored while this one compiled: it stays.
                    if unusable:
                        with contextlib.suppress(OSError):
                            path.unlink(missing_ok=True)
            self.loaded[key] = compiled
            return compiled, how


# An executable that JAX's persistent compilation cache returned (deserialised) cannot be stored again:
# on XLA:CPU (jax 0.11.2) serialize_executable of such an executable writes an entry whose kernels are
# missing, and every process that loads it fails at its first call ("INTERNAL: Error dispatching
# computation: Function wrapped_iota not found"). A process that compiles a program another process
# put in JAX's cache (servers and trainers sharing one cache directory) gets one. Compilations hit JAX's
# cache per thread, so the hits are counted per thread.
_jax_cache = threading.local()


def _note_jax_cache_hit(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _jax_cache.hits = _jax_cache_hits() + 1


def _jax_cache_hits() -> int:
    return getattr(_jax_cache, "hits", 0)


jax.monitoring.register_event_listener(_note_jax_cache_hit)


def cached(fn, *static: str) -> CachedFunction:
    """`fn` (a jax.jit function with static_argnames `static`) through the executable cache."""
    return CachedFunction(fn, static)


def _read(path: Path, text: str):
    """The executable stored at `path` for key `text`, or None (absent, or unusable: logged)."""
    start = time.perf_counter()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("executable cache: cannot read %s (%s); compiling", path, e)
        return None
    try:
        if not data.startswith(MAGIC):
            raise ValueError("not an rlkjax executable")
        digest, payload = data[len(MAGIC) : len(MAGIC) + 32], data[len(MAGIC) + 32 :]
        if hashlib.sha256(payload).digest() != digest:
            raise ValueError("checksum mismatch (truncated or corrupt)")
        stored_text, in_tree, out_tree, blob = pickle.loads(payload)
        if stored_text != text:
            raise ValueError("stored for another key")
        compiled = serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
    except Exception as e:  # whatever is wrong with the entry, compiling again is always right
        log.warning("executable cache: ignoring %s (%s: %s); compiling", path, type(e).__name__, e)
        return None
    jax.monitoring.record_event_duration_secs(LOAD_EVENT, time.perf_counter() - start)
    return compiled


def _write(path: Path, text: str, compiled) -> None:
    """Store `compiled` atomically (a temporary file, then a rename); a failure is logged, not raised."""
    try:
        blob, in_tree, out_tree = serialize_executable.serialize(compiled)
        payload = pickle.dumps((text, in_tree, out_tree, blob), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # an executable this backend cannot serialize: it still runs, from memory
        log.warning("executable cache: cannot serialize %s (%s: %s)", path.name, type(e).__name__, e)
        return
    # one temporary name per process and thread: servers sharing the directory never write one file
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(MAGIC + hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, path)
    except OSError as e:  # a full disk, a read-only directory
        log.warning("executable cache: cannot store %s (%s)", path, e)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
