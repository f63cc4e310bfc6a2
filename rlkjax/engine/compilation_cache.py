"""JAX's persistent compilation cache, on by default for `python -m serve.rollout` and `python -m train.grpo`.

A compiled executable is stored on disk under a key that covers the program, the JAX/jaxlib version,
the device kind and the XLA flags; a later process that compiles the same program loads it instead. A
hit loads the executable the cold compile produced, so the bits of every result are the same (the server
tests check it), and a restarted server skips most of its warm-up. The cache grows without bound: delete
the directory to reclaim the space (JAX rebuilds what it needs).
"""

import logging
import os
from pathlib import Path

import jax

from rlkjax.engine import executable_cache

log = logging.getLogger("rlkjax.engine.compilation_cache")

OFF = "off"
# Cache every program, however fast it compiled (JAX's default skips those under 1 s): on a busy machine
# the same program takes several times as long, and a threshold makes which ones are cached vary.
MIN_COMPILE_SECONDS = 0.0
# JAX's monitoring events that split the time to a compiled program (summed by CompileTimes).
_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read",
    executable_cache.LOAD_EVENT: "executable_load",
}


def default_dir() -> str:
    """$XDG_CACHE_HOME/rlkjax/jax, or ~/.cache/rlkjax/jax where XDG_CACHE_HOME is not set."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rlkjax", "jax")


def check(setting: str, flag: str = "--compilation-cache") -> None:
    """A config's __post_init__ check: 'off' or a directory path (not an empty string, not an existing file)."""
    if setting != OFF and (not setting.strip() or Path(setting).expanduser().is_file()):
        raise ValueError(f"{flag}={setting!r} must be a directory or 'off'")


def enable(setting: str) -> str | None:
    """Before the first compilation: use the cache in directory `setting`, or none at all for 'off' (also
    overriding JAX_COMPILATION_CACHE_DIR); the executable cache goes with it. Returns the directory, or None."""
    if setting == OFF:
        jax.config.update("jax_enable_compilation_cache", False)
        executable_cache.use_directory(None)
        log.info("persistent compilation cache off: every program compiles")
        return None
    path = Path(setting).expanduser().absolute()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    executable_cache.use_directory(path / "executables")
    log.info("persistent compilation cache: %s (--compilation-cache DIR|off)", path)
    return str(path)


class CompileTimes:
    """Seconds spent tracing, lowering, compiling, reading JAX's cache and loading whole executables while
    active, from JAX's monitoring events: says where a start-up's time went (JAX's cache removes only the
    compile part, a loaded executable all three)."""

    def __init__(self):
        self.seconds = dict.fromkeys(_EVENTS.values(), 0.0)
        self.cache_hits = self.executables_loaded = 0

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if event in _EVENTS:
            self.seconds[_EVENTS[event]] += duration
            self.cache_hits += event == "/jax/compilation_cache/cache_retrieval_time_sec"
            self.executables_loaded += event == executable_cache.LOAD_EVENT

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items())
        return f"{parts}; {self.cache_hits} programs from the cache, {self.executables_loaded} executables loaded"
